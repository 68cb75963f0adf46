"""Where an encoding's time goes: torch.profiler over one training step and one evaluation forward, the operators
that take the most self time, and the share of the step spent inside attention's row blocks (``_from_logits``,
CoPE's and DAPEv2's scores) and inside the whole attention call.

    python tools/profile_encoding.py --pes nope cope dape_v2+cable --train-length 512 --eval-length 4096
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cable_lightning.bench.variants import make_config
from cable_lightning.models import attention as attention_module
from cable_lightning.models import backbone as backbone_module
from cable_lightning.models import build_backbone


def labelled(name, fn):
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def profiled(fn, top):
    fn()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    spans = {e.key: e.cpu_time_total for e in events if e.key in ("attention", "row block scores")}
    ops = sorted((e for e in events if e.key not in spans), key=lambda e: -e.self_cpu_time_total)[:top]
    lines = [f"  total {total / 1e6:.2f} s; attention {spans.get('attention', 0) / total:.0%}, "
             f"of which row-block scores {spans.get('row block scores', 0) / total:.0%}"]
    lines += [f"  {e.key:<40} {e.self_cpu_time_total / 1e6:6.2f} s {e.self_cpu_time_total / total:5.0%}" for e in ops]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-tiny")
    parser.add_argument("--n-layer", dest="n_layer", type=int, default=2)
    parser.add_argument("--n-head", dest="n_head", type=int)
    parser.add_argument("--n-embd", dest="n_embd", type=int)
    parser.add_argument("--vocab-size", dest="vocab_size", type=int, default=8192)
    parser.add_argument("--pes", nargs="+", default=["nope", "cope", "dape_v2+cable"])
    parser.add_argument("--train-length", type=int, default=512)
    parser.add_argument("--tokens-per-step", type=int, default=4096)
    parser.add_argument("--eval-length", type=int, default=4096)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    backbone_module.attention = labelled("attention", attention_module.attention)
    attention_module._from_logits = labelled("row block scores", attention_module._from_logits)
    for pe in args.pes:
        torch.manual_seed(0)
        model = build_backbone(make_config(args, pe, args.train_length))
        batch = max(1, args.tokens_per_step // args.train_length)
        x = torch.randint(0, model.config.vocab_size, (batch, args.train_length + 1))

        def step():
            model.loss(x[:, :-1], x[:, 1:]).backward()
            model.zero_grad(set_to_none=True)

        long = torch.randint(0, model.config.vocab_size, (1, args.eval_length + 1))

        def evaluate():
            with torch.no_grad():
                model.token_nll(long[:, :-1], long[:, 1:])

        print(f"{pe}: training step at {args.train_length} (batch {batch})\n{profiled(step, args.top)}")
        print(f"{pe}: evaluation forward at {args.eval_length}\n{profiled(evaluate, args.top)}", flush=True)


if __name__ == "__main__":
    main()

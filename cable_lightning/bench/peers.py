"""``--peers``: transformers' own models at the backbone's shape, and the CABLE paper's released computation
(:mod:`.peer_models`), each against the project's encoding it matches, their training steps (and for a peer that reads
any length, its evaluation forwards) timed in turns in this process."""

from __future__ import annotations

import torch

from ..eval.tables import markdown_table
from ..models import build_backbone
from ..timing import interleaved
from .memory import eval_peak_mib
from .peer_models import PEERS, build_peer
from .steps import eval_forward, peer_eval_forward, peer_train_step, train_step, training_batch
from .variants import make_config, parameter_count, row_name


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def peer_rows(args, device, dtype) -> list[dict]:
    """Each peer (:data:`.peer_models.PEERS`) against the backbone with the encoding it matches, same shape, at each
    training length: both steps timed in turns in this process (:func:`timing.interleaved`); ``ratio`` is the
    backbone's tokens/s over the peer's."""
    rows = []
    for name in args.peers:
        against = PEERS[name].against
        torch.manual_seed(0)
        config = make_config(args, against, max(args.train_lengths))
        model, peer = build_backbone(config).to(device), build_peer(name, config).to(device)
        row = {"peer": name, "peer_model": type(peer).__name__, "against": row_name(against),
               "params": parameter_count(model),
               "peer_params": parameter_count(peer), "tok_s": {}, "peer_tok_s": {}, "ratio": {}}
        for t in args.train_lengths:
            x = training_batch(config.vocab_size, t, args.tokens_per_step, device)
            ours, theirs = interleaved([train_step(model, x, device, dtype), peer_train_step(peer, x, device, dtype)],
                                       device, args.repeats)
            tokens = x.shape[0] * t
            row["tok_s"][t], row["peer_tok_s"][t], row["ratio"][t] = tokens / ours, tokens / theirs, theirs / ours
        if PEERS[name].evaluates_longer:
            row |= {"eval_s": {}, "peer_eval_s": {}, "eval_ratio": {}, "eval_mib": {}, "peer_eval_mib": {}}
            model.eval(), peer.eval()
            for t in args.eval_lengths:
                ours, theirs = interleaved([eval_forward(model, t, device, dtype),
                                            peer_eval_forward(peer, config.vocab_size, t, device, dtype)],
                                           device, args.repeats)
                row["eval_s"][t], row["peer_eval_s"][t], row["eval_ratio"][t] = ours, theirs, theirs / ours
                if not args.skip_memory:
                    row["eval_mib"][t] = eval_peak_mib(model, t, device, dtype)
                    row["peer_eval_mib"][t] = eval_peak_mib(peer, t, device, dtype, peer=name)
        rows.append(row)
        print(f"measured peer {name}", flush=True)
    return rows


def peer_table(rows) -> str:
    ts = list(rows[0]["tok_s"])
    head = ["peer", "against", "parameters (peer / project)"] + [f"train tok/s @{t}: project / peer (x peer)"
                                                                   for t in ts]
    body = [[f"{r['peer']} ({r['peer_model']})", r["against"],
             f"{r['peer_params']:,} / {r['params']:,}"]
            + [f"{r['tok_s'][t]:.0f} / {r['peer_tok_s'][t]:.0f} ({r['ratio'][t]:.2f}x)" for t in ts] for r in rows]
    text = markdown_table(head, body)
    for r in (r for r in rows if "eval_s" in r):  # a peer that reads longer inputs: its evaluation too
        memory = bool(r["eval_mib"])
        text += "\n\n" + markdown_table(
            ["eval length", f"{r['against']} s", f"{r['peer']} s", f"{r['peer']} / {r['against']}"]
            + ([f"{r['against']} peak MiB", f"{r['peer']} peak MiB"] if memory else []),
            [[t, f"{r['eval_s'][t]:.3f}", f"{r['peer_eval_s'][t]:.3f}", f"{r['eval_ratio'][t]:.2f}x"]
             + ([f"{r['eval_mib'][t]:.0f}", f"{r['peer_eval_mib'][t]:.0f}"] if memory else [])
             for t in r["eval_s"]])
    return text

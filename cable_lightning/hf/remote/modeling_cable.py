"""transformers models around a cable_lightning ``Backbone``, for a folder that ``python -m cable_lightning export``
wrote.

This file is copied into every exported folder and loaded by transformers (``trust_remote_code=True``); it must
not import cable_lightning. The backbone is not retyped here: the folder carries a copy of the package's own model
code in ``cable_core/`` (models, positional encodings, errors), which :func:`load_core` imports by path (transformers
copies only single-file relative imports into its module cache, not sub-packages).

- ``CableModel`` (``AutoModel``): final-LayerNorm hidden states (sentence-transformers pools these).
- ``CableForCausalLM`` (``AutoModelForCausalLM``): logits, a loss for ``labels`` and ``generate`` with the
  backbone's own KV cache (:class:`CableCache`: keys, values and the positional encoding's state, e.g. CABLE's
  cumulative sums), so decoding equals the package's ``Backbone.generate``.
- ``CableForMaskedLM`` (``AutoModelForMaskedLM``): logits and a loss for ``labels`` (-100 = not scored).

Padding: an ``attention_mask`` with zeros (left or right padding) goes to the backbone as its padding mask, so a
padded batch runs in one call and each row's real tokens get what running them alone would give; padded positions
get zero hidden states. Such batches cannot use the KV cache.
"""

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from transformers import Cache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast, MaskedLMOutput
from transformers.utils import cached_file

from .configuration_cable import CableConfig

CORE = "cable_core"
# transformers renamed the cache from ``past_key_values`` to ``cache`` during 5.x (generate passes it under the new
# name and reads it back from the output's field of that name); the output class says which name it has.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def core_paths(config):
    """Where the folder's (or hub repository's, once fetched) copy of the model code is: one path per core file."""
    if not config.core_files or not config.name_or_path:
        raise ValueError(f"{type(config).__name__} has no core_files or name_or_path: load it with from_pretrained "
                         "from a folder written by `python -m cable_lightning export`")
    for name in config.core_files:  # paths read from the folder's config.json stay inside the folder's cable_core/
        parts = str(name).replace("\\", "/").split("/")
        if os.path.isabs(str(name)) or ".." in parts or "" in parts:
            raise ValueError(f"core_files entry {name!r} in {config.name_or_path}/config.json leaves {CORE}/; valid: "
                             f"relative paths inside {CORE}/ (e.g. models/backbone.py)")
    return [cached_file(config.name_or_path, f"{CORE}/{name}", _commit_hash=getattr(config, "_commit_hash", None))
            for name in config.core_files]


def load_core(config):
    """The exported folder's copy of cable_lightning's model code, imported under a name unique to its contents
    (two exports of different code versions load side by side; an installed cable_lightning is never used)."""
    files = core_paths(config)
    digest = hashlib.sha256()
    for name, path in zip(config.core_files, files):
        with open(path, "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    module_name = f"{CORE}_{digest.hexdigest()[:16]}"
    if module_name not in sys.modules:
        root = os.path.dirname(files[config.core_files.index("__init__.py")])
        spec = importlib.util.spec_from_file_location(module_name, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
            for package in ("models", "positional"):
                importlib.import_module(f"{module_name}.{package}")
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


class CableCache(Cache):
    """transformers' handle on the backbone's own ``KVCache``: per layer the keys, values and whatever the
    positional encoding keeps (CABLE: the cumulative sums S of past tokens). Every kept tensor has the batch first,
    which is what beam search's reordering relies on."""

    is_compileable = False
    is_croppable = False

    def __init__(self, kv_cache):
        super().__init__(layers=[])
        self.kv = kv_cache

    def __len__(self):
        return len(self.kv.layers)

    def get_seq_length(self, layer_idx=0):
        return self.kv.length

    def _map(self, fn):
        for state in self.kv.layers:
            for key, value in list(state.items()):
                state[key] = fn(value)

    def reorder_cache(self, beam_idx):
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self._map(lambda t: t[indices])

    def reset(self):
        self.kv.layers = [{} for _ in self.kv.layers]
        self.kv.length = 0

    def crop(self, max_length):
        raise NotImplementedError("CableCache cannot be cropped (assisted decoding); generate without an assistant")


class CablePreTrainedModel(PreTrainedModel):
    config_class = CableConfig
    base_model_prefix = "backbone"
    main_input_name = "input_ids"

    def __init__(self, config):
        super().__init__(config)
        self._core_name = load_core(config).__name__  # a name, not the module: models stay deep-copyable
        self.backbone = self._core.models.Backbone(self._core.models.BackboneConfig.from_dict(config.backbone))
        self.post_init()

    @property
    def _core(self):
        return sys.modules[self._core_name]

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' load, refusing weights that do not fit ``config.json`` (an edited ``n_layer``, say):
        transformers would leave the missing ones uninitialised (NaN logits) and drop the extra ones, with a warning
        at most."""
        wanted = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        wrong = [f"{what.replace('_', ' ')} {', '.join(sorted(map(str, info[what]))[:3])}"
                 + (" ..." if len(info[what]) > 3 else "")
                 for what in ("missing_keys", "unexpected_keys") if info[what]]
        if wrong:
            folder = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            raise ValueError(f"the weights in {folder} do not fit its config.json ({'; '.join(wrong)}); undo the edit "
                             "to config.json or export the checkpoint again")
        return (model, info) if wanted else model

    def _init_weights(self, module):
        """Weights come from the file (the backbone initialises its own when built from a config); only the
        positional encoding's non-persistent buffers (RoPE frequencies, ALiBi slopes), which transformers leaves
        empty when it builds the model on the meta device, are computed again, module by module."""
        pe = getattr(getattr(self, "backbone", None), "pe", None)
        where = {id(m): name for name, m in pe.named_modules()} if pe is not None else {}
        if id(module) in where and module._non_persistent_buffers_set:
            fresh = self._core.positional.build_positional(self.backbone.config).get_submodule(where[id(module)])
            with torch.no_grad():
                for name in module._non_persistent_buffers_set:
                    getattr(module, name).copy_(getattr(fresh, name))

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save (config, weights, these two files), plus the copy of the model code they import."""
        super().save_pretrained(save_directory, *args, **kwargs)
        for name, source in zip(self.config.core_files, core_paths(self.config)):
            target = os.path.join(save_directory, CORE, name)
            if not (os.path.exists(target) and os.path.samefile(source, target)):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(source, target)

    def get_input_embeddings(self):
        return self.backbone.wte

    def hidden_states(self, input_ids, attention_mask=None, kv_cache=None):
        """Final-LayerNorm hidden states (B, T, C), each row as if run at the length of its real tokens."""
        return self.backbone.hidden_states(input_ids, kv_cache, padding_mask=attention_mask)


class CableModel(CablePreTrainedModel):
    def forward(self, input_ids, attention_mask=None, return_dict=None, **kwargs):
        hidden = self.hidden_states(input_ids, attention_mask)
        return BaseModelOutput(last_hidden_state=hidden) if return_dict is not False else (hidden,)


class CableForCausalLM(CablePreTrainedModel, GenerationMixin):
    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # forward makes a CableCache (transformers' DynamicCache would lose the PE's state)

    def forward(self, input_ids, attention_mask=None, cache=None, past_key_values=None, use_cache=None, labels=None,
                return_dict=None, **kwargs):
        """The cache comes as ``cache`` (newer transformers) or ``past_key_values`` (older): either is read, and
        the output carries it under the installed transformers' field name (:data:`CACHE_FIELD`)."""
        if cache is not None and past_key_values is not None:
            raise ValueError("got both cache and past_key_values; pass the KV cache once, as cache")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = CableCache(self._core.models.KVCache(len(self.backbone.blocks)))
        if cache is not None and not isinstance(cache, CableCache):
            raise TypeError(f"the KV cache must be a CableCache (or None: forward makes one), "
                            f"got {type(cache).__name__}")
        hidden = self.hidden_states(input_ids, attention_mask, cache.kv if cache is not None else None)
        logits = self.backbone.logits(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
        return output if return_dict is not False else output.to_tuple()


class CableForMaskedLM(CablePreTrainedModel):
    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=None, **kwargs):
        logits = self.backbone.logits(self.hidden_states(input_ids, attention_mask))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        output = MaskedLMOutput(loss=loss, logits=logits)
        return output if return_dict is not False else output.to_tuple()

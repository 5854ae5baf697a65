"""Greedy decoding with the programs transformers' exporters make of a samba-hf model.

`exporter.export_for_generation(model, {"input_ids": ...}, config)` (transformers' `DynamoExporter`,
`ExecutorchExporter`, `OnnxExporter`) writes two programs: `prefill` (the prompt, from an empty cache) and `decode`
(one token, from the cache the last call returned). transformers 5.24 drives neither; `generate_exported` is the
loop: prefill once, then decode a token at a time, greedy, on whichever backend the programs run.

The cache a program returns holds the right tensors, but the decode program's input structure records the Python
attributes the cache had when generate ran it eagerly (a sliding-window layer's token count), which a traced prefill
does not reproduce; the runner refuses it then (transformers' Mistral alike). `generate_exported` hands the decode
program the same tensors in the structure it was traced with.

The exported sliding-window layers keep every position (transformers' exporter traces them as full layers, the mask
applying the window): the tokens are the model's, the memory grows with the text. samba-hf's own on-device program,
with a bounded state, is a separate export.
"""

import torch
from torch.utils import _pytree as pytree


def generate_exported(
    exported, config, input_ids: torch.LongTensor, max_new_tokens: int, eos_token_id: int | None = None
) -> torch.LongTensor:
    """`input_ids` (1, prompt) followed by up to `max_new_tokens` greedy tokens, from the `prefill` and `decode`
    components of `exported` (an `ExportedModel` from `export_for_generation`); `config` is the model's (the cache's
    layer kinds). Stops after `eos_token_id` where given."""
    from transformers import DynamicCache, StaticCache

    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"generate_exported takes one sequence, input_ids of shape (1, length), got {input_ids.shape}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    missing = {"prefill", "decode"} - set(exported.runners)
    if missing:
        raise ValueError(
            f"the exported model has no {', '.join(sorted(missing))} component: export it with "
            "export_for_generation (not export), which writes a prefill and a decode program"
        )
    prefill, decode = exported.runners["prefill"], exported.runners["decode"]
    names, cache_structure = _inputs(exported.components["decode"].metadata.in_spec)
    generation_config = getattr(exported, "generation_config", None)
    if getattr(generation_config, "cache_implementation", None) == "static":  # as generate made it when exported
        cache = StaticCache(config=config, max_cache_len=generation_config.max_cache_len)
    else:
        cache = DynamicCache(config=config)
    length = input_ids.shape[1]

    def run(program, ids, position, cache):
        # what generate handed the forward when it was exported: the positions, a mask over every token so far where
        # it took one (a static cache), and the cache under transformers' name for it
        kwargs = {"input_ids": ids, "position_ids": torch.arange(position, position + ids.shape[1])[None]}
        if "attention_mask" in names:
            kwargs["attention_mask"] = torch.ones(1, position + ids.shape[1], dtype=torch.long)
        return program(**kwargs, **{names[-1]: cache})

    out = run(prefill, input_ids, 0, cache)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for position in range(length, length + max_new_tokens - 1):
        if eos_token_id is not None and int(tokens[-1]) == eos_token_id:
            break
        cache = pytree.tree_unflatten(pytree.tree_leaves(out[names[-1]]), cache_structure)
        out = run(decode, tokens[-1], position, cache)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat([input_ids, *tokens], dim=1)


def _inputs(in_spec) -> tuple[list[str], pytree.TreeSpec]:
    """A component's keyword arguments as torch.export flattened its call, ((), {name: value}), the cache's last
    (`cache` from transformers 5.24 on, `past_key_values` before); and the cache's structure."""
    from transformers.exporters.metadata import load_treespec

    def child(spec, index):  # (`children_specs` is deprecated from torch 2.12 on)
        return spec.child(index) if hasattr(spec, "child") else spec.children_specs[index]

    kwargs = child(load_treespec(in_spec), 1)
    cache = "cache" if "cache" in kwargs.context else "past_key_values"
    names = [name for name in kwargs.context if name != cache] + [cache]
    return names, child(kwargs, kwargs.context.index(cache))

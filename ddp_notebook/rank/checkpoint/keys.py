"""State dict keys without the wrappers' prefixes (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch

from ...wire.payload import unwrap_model


def strip_key(key: str, leading: int = 0) -> str:
    """``key`` without ``_orig_mod`` components and without ``leading`` leading components."""
    parts = [p for p in key.split(".") if p != "_orig_mod"] if key else []
    return ".".join(parts[leading:])


def translate_keys(state: Mapping[str, Any], rename) -> "OrderedDict[str, Any]":
    """Rename the keys of a state dict, and of its ``_metadata`` (module versions) alike."""
    renamed = OrderedDict((rename(k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        # Deeper entries come later and win: DDP's "module" entry becomes the plain model's "".
        renamed._metadata = OrderedDict((rename(k), v) for k, v in metadata.items())
    return renamed


def _rename(state: Mapping[str, Any], leading: int) -> "OrderedDict[str, Any]":
    """Drop every ``_orig_mod`` component and ``leading`` leading ``module`` components."""
    return translate_keys(state, lambda key: strip_key(key, leading))


def _leading_module_components(keys: Sequence[str]) -> int:
    """How many leading ``module.`` components every key shares (DDP wrapping, possibly nested)."""
    split = [[p for p in k.split(".") if p != "_orig_mod"] for k in keys]
    count = 0
    while split and all(len(parts) > count + 1 and parts[count] == "module" for parts in split):
        count += 1
    return count


def clean_state_dict(state_dict: Mapping[str, Any],
                     expected_keys: Sequence[str] | None = None) -> "OrderedDict[str, Any]":
    """A state dict with the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes removed.

    ``_orig_mod`` components go wherever they are; leading ``module.``
    components go when every key has them.  Given the keys the target model
    expects, only as many ``module.`` components are removed as make the keys
    match (a plain model may own a submodule that is really called ``module``).
    """
    keys = list(state_dict)
    most = _leading_module_components(keys)
    if expected_keys is not None:
        wanted = set(expected_keys)
        for leading in range(most + 1):
            if {strip_key(k, leading) for k in keys} == wanted:
                return _rename(state_dict, leading)
    return _rename(state_dict, most)


def plain_model_state(model: torch.nn.Module) -> "OrderedDict[str, Any]":
    return _rename(unwrap_model(model).state_dict(), 0)

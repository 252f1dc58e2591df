"""What ``torch.load(weights_only=True)`` accepts: values made plain, and refused before anything is written."""
from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any, Mapping

import torch


def plain_values(value: Any) -> Any:
    """numpy values as Python numbers or tensors, so ``torch.load(weights_only=True)`` takes them."""
    module = type(value).__module__
    if module == "numpy" or module.startswith("numpy."):
        import numpy as np

        if isinstance(value, np.ndarray):
            return torch.from_numpy(value.copy())
        if isinstance(value, np.generic):
            return value.item()
    if isinstance(value, dict):
        converted = {k: plain_values(v) for k, v in value.items()}
        return OrderedDict(converted) if isinstance(value, OrderedDict) else converted
    if isinstance(value, list):
        return [plain_values(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(plain_values(v) for v in value)
    return value


def _loads_weights_only(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _skeleton(value: Any) -> Any:
    """The value with tensors replaced by None: what is left to check is cheap to pickle."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, dict):
        return type(value)((k, _skeleton(v)) for k, v in value.items()) if type(value) in (dict, OrderedDict) \
            else value
    if type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value


def check_weights_only(values: Mapping[str, Any], what: str) -> None:
    """Refuse, before anything is written, values that ``torch.load(weights_only=True)`` would reject."""
    def round_trip(obj: Any) -> None:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        _loads_weights_only(buffer.getvalue())

    values = {k: _skeleton(v) for k, v in values.items()}
    try:
        round_trip(values)
        return
    except Exception:  # noqa: BLE001 - find the culprit below
        pass
    for key, value in values.items():
        try:
            round_trip({key: value})
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"{what} {key!r} ({type(value).__name__}) cannot be loaded back with "
                            f"torch.load(weights_only=True); store numbers, strings, tensors, lists or dicts "
                            f"instead. ({type(exc).__name__})") from None
    raise TypeError(f"{what} cannot be loaded back with torch.load(weights_only=True)")

"""Each rank's RNG state: captured, restored, and kept in a small file of its own beside a checkpoint."""
from __future__ import annotations

import os
import random
from typing import Any, Mapping

import torch

from ...wire import safe_files
from .files import atomic_save
from .format import RNG_SAVES_FORMAT, RNG_SAVES_KEPT


_rng_saves: dict[str, list[tuple[str, dict]]] = {}  # rng_path -> this rank's latest (tag, state), oldest first


def rng_path(path: str, rank: int) -> str:
    """Where rank ``rank`` keeps its RNG state for the checkpoint at ``path``."""
    return f"{path}.rank{rank}.rng"


def save_rng(file: str, rank: int, tag: str, state: dict, file_mode: int) -> None:
    """Write ``file``, this rank's RNG file beside a one-file checkpoint, with ``state`` under ``tag`` and the
    states of this rank's :data:`RNG_SAVES_KEPT` - 1 saves before it.  Each rank renames its file into place on its
    own, before or after rank 0 commits the model file, which names the save it belongs to (``rng_tag``): keeping
    the previous saves' states too, the file has the state of whichever save the model file names, also after a
    crash between the two renames."""
    saves = _rng_saves.get(file)
    if saves is None:  # this process's first save of the path: keep those of an earlier run
        saves = list(_read_rng_file(file, own_only=True).items())
    saves = [(t, s) for t, s in saves if t != tag]
    saves = saves[max(0, len(saves) - RNG_SAVES_KEPT + 1):] + [(tag, state)]
    atomic_save({"format": RNG_SAVES_FORMAT, "rank": rank, "saves": dict(saves)}, file, file_mode)
    _rng_saves[file] = saves


def _read_rng_file(file: str, own_only: bool = False) -> dict[str, dict]:
    """The RNG states in a rank's RNG file beside a one-file checkpoint, by save tag: {} if there is none, it is
    unreadable or (``own_only``) it is not a plain file of this user's."""
    try:
        fd = safe_files.open_own_file(file, os.O_RDONLY) if own_only else os.open(file, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            saved = torch.load(f, map_location="cpu", weights_only=True)
    except Exception:  # (missing, torn, not a checkpoint's: no state to restore, which a resume reports)
        return {}
    if not isinstance(saved, dict):
        return {}
    if isinstance(saved.get("saves"), dict):
        return saved["saves"]
    if "tag" in saved and "state" in saved:  # one save's, as RNG_FORMAT (versions before RNG_SAVES_FORMAT)
        return {saved["tag"]: saved["state"]}
    return {}


def job_id() -> str:
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.environ["TORCHELASTIC_RUN_ID"]
    if os.environ.get("MASTER_PORT"):
        return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
    return f"local:{os.getpid()}"


def rng_state() -> dict[str, Any]:
    """This process's Python, numpy, torch and CUDA RNG states, in types weights_only loading accepts."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state(),
                             "numpy": None, "cuda": None}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("numpy") is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


def rng_file(path: str, rank: int, folder: str | None) -> str:
    """Rank ``rank``'s RNG state file: beside a single-file checkpoint, in a sharded checkpoint's save folder."""
    return rng_path(path, rank) if folder is None else os.path.join(folder, f"rank{rank}.rng")


def load_rng(path: str, world_size: int, tag: str | None, rank: int,
              folder: str | None = None) -> tuple[dict | None, list[int]]:
    mine, missing = None, []
    for r in range(world_size):
        file = rng_file(path, r, folder)
        if folder is None:
            state = _read_rng_file(file).get(tag)  # (None: missing, or only other saves' states)
        else:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)["state"]
            except FileNotFoundError:
                state = None
        if state is None:
            missing.append(r)
        elif r == rank:
            mine = state
    return mine, missing


def forget_saves(file: str) -> None:
    """The checkpoint that ``file`` (its RNG file) belongs to was removed: its RNG states go with it."""
    _rng_saves.pop(file, None)

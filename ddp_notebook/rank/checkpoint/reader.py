"""A ``torch.distributed.checkpoint`` folder read with the guarantee of ``torch.load(weights_only=True)``: nothing
in it is run, whoever wrote it.

``torch.distributed.checkpoint``'s own ``FileSystemReader`` unpickles the folder's ``.metadata`` with a plain
``pickle.load``, and its load planners read each non-tensor value with ``torch.load(weights_only=False)``: a folder
someone handed over (or planted in a shared folder) runs what its pickles say.  :class:`WeightsOnlyReader` is that
reader with both reads made safe:

- ``.metadata`` is unpickled by a ``pickle.Unpickler`` that finds only DCP's own metadata classes and the few
  torch values they hold (``torch.Size``, dtypes, layouts; ``pathlib`` paths) and whatever the user allowed with
  ``torch.serialization.add_safe_globals``.  (torch's weights-only unpickler itself cannot be used: it reads pickle
  protocol 2, and DCP writes protocol 4.)
- each non-tensor value is checked with ``torch.load(weights_only=True)`` before the planner reads it, whatever the
  planner; tensors DCP already reads weights-only.
- the files the metadata names must be plain names inside the folder.

A refused folder raises :class:`UnsafeCheckpointError` (an ``UnpicklingError``) naming the file.
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_FILE = ".metadata"
# What a DCP .metadata holds: module -> names.  The torch dtypes are found by type (see _allowed).
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "TensorProperties", "BytesStorageMetadata", "StorageMeta",
                                              "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds pickled objects that ``torch.load(weights_only=True)`` would not load: refused, and
    nothing in it was run."""


def _allowed(module: str, name: str) -> Any:
    """The object a metadata pickle may name as ``module.name``, or None."""
    if name in _METADATA_GLOBALS.get(module, ()):
        return getattr(importlib.import_module(module), name)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    for entry in torch.serialization.get_safe_globals():  # the user's own (add_safe_globals, safe_globals())
        obj, qualified = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        if qualified == f"{module}.{name}":
            return obj
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.path}: not loaded: it names {module}.{name}, which is not part of a torch.distributed."
                f"checkpoint metadata file (nothing in it was run; a checkpoint you trust that needs it can allow it "
                f"with torch.serialization.add_safe_globals)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.path}: not loaded: a metadata file holds no persistent ids")


class _WeightsOnlyValues:
    """A load planner as the reader hands it non-tensor values: each checked by torch's weights-only unpickler
    first; the checked bytes go on to the planner itself."""

    def __init__(self, planner: Any, reader: "WeightsOnlyReader"):
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            file = self._reader.file_of(read_item)
            raise UnsafeCheckpointError(
                f"{file}: not loaded: its value {read_item.dest_index.fqn!r} is a pickled object that "
                f"torch.load(weights_only=True) refuses, and nothing in it was run ({_reason(exc)})") from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def _reason(exc: Exception) -> str:
    """What torch's weights-only unpickler refused, in one line: its message says it between a first line on the
    ``weights_only`` default and a last one pointing to the documentation."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[1:-1] if len(lines) > 2 else lines) or type(exc).__name__


class WeightsOnlyReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` that runs nothing the folder holds (see the module).

    The folder's metadata is read once per reader: call :meth:`read_metadata` before ``dcp.load`` to have a refused
    folder raise there, not inside ``dcp.load`` (which logs the error and goes on to look for other metadata)."""

    _metadata: Any = None

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self._metadata = None

    def _file(self, name: str) -> str:
        return os.fspath(self.fs.concat_path(self.path, name))

    def file_of(self, read_item: Any) -> str:
        return self._file(self.storage_data[read_item.storage_index].relative_path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            return self._metadata
        path = self._file(METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: not a torch.distributed.checkpoint metadata file")
        for info in (metadata.storage_data or {}).values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
                raise UnsafeCheckpointError(f"{path}: not loaded: it names the data file {name!r}, which is not a "
                                            f"file of the folder itself")
        if getattr(metadata, "storage_meta", None) is None:  # (as FileSystemReader.read_metadata does)
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if rank is None:
            self._metadata = metadata
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _WeightsOnlyValues(planner, self))

"""PyTorch model repositories built at test time: TorchScript (torch.jit.script) and
torch.export programs, saved by torch itself (no binary blobs)."""
from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import torch

# One entry per dtype the backend maps: config type, torch dtype.
DTYPES = [("TYPE_INT64", torch.int64), ("TYPE_FP16", torch.float16), ("TYPE_BOOL", torch.bool),
          ("TYPE_UINT8", torch.uint8), ("TYPE_INT8", torch.int8), ("TYPE_INT16", torch.int16),
          ("TYPE_INT32", torch.int32), ("TYPE_FP64", torch.float64), ("TYPE_BF16", torch.bfloat16)]


class AddSub(torch.nn.Module):
    def forward(self, x, y):
        return x + y, x - y


class Named(torch.nn.Module):
    def forward(self, x, y):
        return 2 * x - y


class Dtypes(torch.nn.Module):
    """One output per input of each dtype, computed in that dtype."""

    def forward(self, i64, f16, b, u8, i8, i16, i32, f64, bf16):
        return (i64 * 3 - 1, f16 * 0.5, ~b, u8 + 1, -i8, i16 * 2, i32 // 2, f64 / 3, bf16 * 2)


class Upper(torch.nn.Module):
    def forward(self, words: list[str]) -> list[str]:
        return [w.upper() for w in words]


class DictInput(torch.nn.Module):
    def forward(self, inputs: dict[str, torch.Tensor]):
        return inputs["a"] * inputs["b"]


class Checked(torch.nn.Module):
    """sqrt of a non-negative input; a negative element fails the whole execution."""

    def forward(self, x):
        torch._assert(bool((x >= 0).all()), "INPUT__0 must be non-negative")
        return x.sqrt()


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


class IntArg(torch.nn.Module):
    def forward(self, x, n: int):
        return x * n


class InPlace(torch.nn.Module):
    """Writes into its input, so the backend must not hand it read-only shared memory."""

    def forward(self, x):
        x.mul_(2)
        return x + 1


class Modes(torch.nn.Module):
    """Reports how it runs: [input is an inference tensor, grad enabled]."""

    def forward(self, x):
        return torch.tensor([x.is_inference(), torch.is_grad_enabled()], dtype=torch.bool)


def save_script(module: torch.nn.Module, model_dir: Path, version: int = 1,
                filename: str = "model.pt") -> Path:
    with warnings.catch_warnings():   # torch.jit.script is deprecated, still what Triton loads
        warnings.simplefilter("ignore")
        scripted = torch.jit.script(module)
    path = Path(model_dir) / str(version) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    scripted.save(str(path))
    return path


def save_exported(model_dir: Path, size: int = 16, version: int = 1) -> Path:
    """AddSub exported with a dynamic batch dimension, as model.pt2."""
    batch = torch.export.Dim("batch", min=1, max=64)
    example = (torch.zeros(2, size), torch.zeros(2, size))
    ep = torch.export.export(AddSub(), example, dynamic_shapes=({0: batch}, {0: batch}))
    path = Path(model_dir) / str(version) / "model.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(ep, str(path))
    return path


def corrupt(model_dir: Path, version: int = 1) -> Path:
    path = Path(model_dir) / str(version) / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"PK\x03\x04 this is not a TorchScript archive")
    return path


def aoti_lookalike(model_dir: Path, version: int = 1) -> Path:
    """A model.pt2 laid out like an AOTInductor package (compiling a real one takes ~30 s)."""
    path = Path(model_dir) / str(version) / "model.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("model/data/aotinductor/model/model.wrapper.so", b"")
    return path


def io(kind: str, name: str, dtype: str, dims: str) -> str:
    return f'{kind} [{{ name: "{name}", data_type: {dtype}, dims: {dims} }}]\n'

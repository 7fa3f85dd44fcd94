"""The pieces of the differential harness (tests/test_differential.py): tiny models with the
features users bring, one set of samples packed into every batch structure users build, the
losses users write, real out-of-memory errors raised at chosen forward and backward points,
and plain torch's answer on the same data.

Everything here is plain torch; memguard is used only by the tests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

D, H, C = 4, 6, 5  # input features per position, hidden width, classes (a few hundred params)

FEATURES = ("batchnorm", "dropout", "tied", "frozen", "lazy", "buffers", "checkpointing",
            "compile")
STRUCTURES = ("tensor", "dict", "nested", "list_equal", "list_unequal", "dataclass", "strings",
              "numpy", "encoding")
LOSSES = ("sample_mean", "token_mean", "sum", "smoothing", "weighted", "pooled")
# also "labelled_mean": each sample's token mean, averaged over the samples with any label
# features whose output depends on which samples share a pass: compared with plain torch
# on the same slices (gradient accumulation), not on the whole batch
COUPLED = frozenset({"batchnorm", "dropout", "buffers"})


# -- data -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Samples:
    """``n`` samples of up to ``length`` positions: features ``x`` [n, L, D], classes ``y``
    [n, L] (-100 on padding), the number of real positions per sample, a weight per sample."""

    x: torch.Tensor
    y: torch.Tensor
    lengths: list[int]
    w: torch.Tensor

    def __len__(self) -> int:
        return len(self.lengths)

    def part(self, start: int, stop: int) -> Samples:
        return Samples(self.x[start:stop], self.y[start:stop], self.lengths[start:stop],
                       self.w[start:stop])


def samples(lengths: list[int], length: int, seed: int) -> Samples:
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    x = torch.randn(n, length, D, generator=g)
    y = torch.randint(0, C, (n, length), generator=g)
    for i, used in enumerate(lengths):
        y[i, used:] = -100
        x[i, used:] = 0.0
    w = torch.randint(1, 4, (n,), generator=g).float() / 2  # 0.5, 1.0, 1.5
    return Samples(x, y, list(lengths), w)


@dataclasses.dataclass
class Batch:
    """A dataclass batch, as some codebases collate."""

    x: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor


def pack(kind: str, s: Samples) -> Any:
    """The samples as a batch of structure ``kind``."""
    if kind == "tensor":  # one tensor: features, class, weight in the last dimension
        n, length = s.y.shape
        return torch.cat([s.x, s.y.unsqueeze(-1).float(),
                          s.w.view(n, 1, 1).expand(n, length, 1)], dim=-1)
    if kind == "dict":
        return {"x": s.x, "y": s.y, "w": s.w}
    if kind == "two_labels":  # a second integer tensor padded with -100 beside the classes
        return {"x": s.x, "y": s.y, "w": s.w, "aux": s.y.flip(0)}
    if kind == "nested":
        return ((s.x,), (s.y, s.w))
    if kind in ("list_equal", "list_unequal"):  # one tensor per sample: its real positions
        return [torch.cat([s.x[i, :used], s.y[i, :used].unsqueeze(-1).float(),
                           s.w[i].expand(used, 1)], dim=-1)
                for i, used in enumerate(s.lengths)]
    if kind == "dataclass":
        return Batch(s.x, s.y, s.w)
    if kind == "strings":  # the weights travel as text beside the tensors
        return {"x": s.x, "y": s.y, "note": [f"w={w:.1f}" for w in s.w.tolist()]}
    if kind == "numpy":
        return {"x": s.x.numpy().copy(), "y": s.y.numpy().copy(), "w": s.w.numpy().copy()}
    if kind == "encoding":
        import transformers
        return transformers.BatchEncoding({"x": s.x, "y": s.y, "w": s.w})
    raise ValueError(kind)


def unpack(kind: str, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
    """(positions [T, D], classes [T] with -100 on padding, sample of each position [T],
    weights [n]) of a batch (or slice) of structure ``kind``."""
    if kind == "tensor":
        n, length, _ = batch.shape
        x, y, w = batch[..., :D], batch[..., D].long(), batch[:, 0, D + 1]
    elif kind in ("dict", "encoding", "two_labels"):
        x, y, w = batch["x"], batch["y"], batch["w"]
    elif kind == "nested":
        (x,), (y, w) = batch
    elif kind == "dataclass":
        x, y, w = batch.x, batch.y, batch.w
    elif kind == "strings":
        x, y = batch["x"], batch["y"]
        w = torch.tensor([float(note[2:]) for note in batch["note"]])
    elif kind == "numpy":
        x, y, w = (torch.from_numpy(batch[k]) for k in ("x", "y", "w"))
    elif kind in ("list_equal", "list_unequal"):
        rows = list(batch)
        flat = torch.cat(rows)
        seg = torch.cat([torch.full((len(r),), i) for i, r in enumerate(rows)])
        w = torch.stack([r[0, D + 1] if len(r) else torch.tensor(1.0) for r in rows])
        return flat[:, :D], flat[:, D].long(), seg, w
    else:
        raise ValueError(kind)
    n, length = y.shape
    seg = torch.arange(n).repeat_interleave(length)
    return x.reshape(n * length, D), y.reshape(-1), seg, w


# -- models -----------------------------------------------------------------------------------
class Net(nn.Module):
    """A per-position classifier with the chosen features."""

    def __init__(self, features: frozenset[str]) -> None:
        super().__init__()
        self.features = features
        self.embed = nn.LazyLinear(H) if "lazy" in features else nn.Linear(D, H)
        if "batchnorm" in features:
            self.norm: nn.Module = (nn.LazyBatchNorm1d() if "lazy" in features
                                    else nn.BatchNorm1d(H))
        else:
            self.norm = nn.Identity()
        self.drop = nn.Dropout(0.25) if "dropout" in features else nn.Identity()
        self.up = nn.Linear(H, H)
        self.down = nn.Linear(H, H)
        if "tied" in features:
            self.down.weight = self.up.weight
        self.head = nn.Linear(H, C)
        if "frozen" in features:
            if "lazy" not in features:  # a lazy module has nothing to freeze yet
                self.embed.requires_grad_(False)
            self.up.bias.requires_grad_(False)
        if "buffers" in features:  # moved by every forward, as running statistics are
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))
            self.register_buffer("centre", torch.zeros(D))
        self.block = self._block
        if "compile" in features:
            self.block = torch.compile(self._block, backend="aot_eager", dynamic=True)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "buffers" in self.features:
            with torch.no_grad():
                self.seen += x.shape[0]
                self.centre.mul_(0.9).add_(0.1 * x.mean(0))
        h = self.norm(self.embed(x))
        if "dropout" in self.features:
            # the mask drawn from the slice's own data: the same slice draws the same mask in
            # memguard's pass and in plain torch's, whatever passes failed before (seeded
            # after the embedding, whose lazy initialisation draws from the same generator)
            torch.manual_seed(int(x.abs().sum().item() * 1000) % 2**31)
        h = torch.tanh(self.drop(h))
        if "checkpointing" in self.features:
            h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        else:
            h = h + self.block(h)
        return self.head(h)


def model(features: frozenset[str], seed: int = 0, materialise: bool = False) -> Net:
    torch.manual_seed(seed)
    net = Net(features)
    if "lazy" in features and materialise:
        with torch.no_grad():
            net(torch.zeros(2, D))
        if "frozen" in features:
            net.embed.requires_grad_(False)
    return net


# -- losses -----------------------------------------------------------------------------------
def loss_value(kind: str, logits: torch.Tensor, y: torch.Tensor, seg: torch.Tensor,
               w: torch.Tensor) -> torch.Tensor:
    """The loss a user writes, of logits [T, C] over classes y [T] (-100 on padding)."""
    if kind == "smoothing":
        return nn.functional.cross_entropy(logits, y, ignore_index=-100, label_smoothing=0.1)
    if kind == "token_mean":
        return nn.functional.cross_entropy(logits, y, ignore_index=-100)
    each = nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="none")
    if kind == "sum":
        return each.sum()
    n = len(w)
    real = (y != -100).float()
    counts = torch.zeros(n).index_add(0, seg, real).clamp(min=1)
    if kind == "pooled":  # one class per sequence, from its positions' mean logits
        pooled = torch.zeros(n, logits.shape[1]).index_add(0, seg, logits * real[:, None])
        target = torch.zeros(n, dtype=torch.long).index_add(0, seg, y.clamp(min=0)) % C
        return nn.functional.cross_entropy(pooled / counts[:, None], target)
    per_sample = torch.zeros(n).index_add(0, seg, each)
    per_sample = per_sample / counts
    if kind == "sample_mean":
        return per_sample.mean()
    if kind == "labelled_mean":  # samples whose labels are all -100 count for nothing
        return per_sample.sum() / torch.zeros(n).index_add(0, seg, real).gt(0).sum()
    if kind == "weighted":
        return (per_sample * w).sum() / w.sum()
    raise ValueError(kind)


def options(loss: str, structure: str) -> dict:
    """What ``auto_microbatch`` is told about the loss, as its guide asks."""
    if loss == "sum":
        return {"reduction": "sum"}
    if loss in ("token_mean", "smoothing"):
        return {"weight": lambda b: (unpack(structure, b)[1] != -100).sum()}
    if loss == "weighted":
        return {"weight": lambda b: unpack(structure, b)[3].sum()}
    return {}


def share(loss: str, part: Samples, whole: Samples) -> float:
    """The weight of a slice's loss in the whole batch's, for plain gradient accumulation."""
    if loss == "sum":
        return 1.0
    if loss in ("token_mean", "smoothing"):
        return float((part.y != -100).sum()) / float((whole.y != -100).sum())
    if loss == "weighted":
        return float(part.w.sum()) / float(whole.w.sum())
    if loss == "labelled_mean":
        return sum(n > 0 for n in part.lengths) / sum(n > 0 for n in whole.lengths)
    return len(part) / len(whole)


def step_loss(net: nn.Module, structure: str, loss: str, batch: Any) -> torch.Tensor:
    x, y, seg, w = unpack(structure, batch)
    return loss_value(loss, net(x), y, seg, w)


def accumulate(net: nn.Module, structure: str, loss: str, s: Samples, size: int) -> float:
    """Plain torch: backward of every slice of ``size`` samples, weighted; the loss."""
    total = 0.0
    for start in range(0, len(s), size):
        part = s.part(start, start + size)
        weight = share(loss, part, s)
        value = step_loss(net, structure, loss, pack(structure, part))
        if weight:  # a slice with nothing to average over (all padding) adds nothing
            (value * weight).backward()
            total += value.item() * weight
    return total


# -- out-of-memory at a chosen point ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Point:
    """An out-of-memory in pass ``number`` (0: the first pass over the step's batch; the
    passes count every call of the model), at the ``hook``-th module call of that pass, in
    forward or in backward (when the gradient reaches that module's output)."""

    number: int
    hook: int
    phase: str

    def __str__(self) -> str:
        return f"pass {self.number}, module call {self.hook}, {self.phase}"


class Injector:
    """Raises a real ``torch.OutOfMemoryError`` at the chosen points, each once: from a
    forward hook of a module, or from a hook on its output's gradient."""

    def __init__(self, net: nn.Module, points: tuple[Point, ...] = ()) -> None:
        self.points = set(points)
        self.fired: list[Point] = []
        self.passes = -1
        self.calls = 0
        self.handles = [net.register_forward_pre_hook(self._new_pass)]
        for module in net.modules():
            if module is not net and not list(module.children()):
                self.handles.append(module.register_forward_hook(self._hook))

    def arm(self, points: tuple[Point, ...]) -> None:
        """New points for the next step (its passes count from 0)."""
        self.points, self.passes = set(points), -1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _new_pass(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():  # a probe without gradients (memguard's checks)
            return
        self.passes += 1
        self.calls = 0

    def _fire(self, point: Point) -> None:
        if point in self.points:
            self.points.discard(point)
            self.fired.append(point)
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {point})")

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        here = self.calls
        self.calls += 1
        self._fire(Point(self.passes, here, "forward"))
        point = Point(self.passes, here, "backward")
        if point in self.points and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._fire(point))


# -- comparing --------------------------------------------------------------------------------
def relative(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    """max |a - b| / max |b| (0 when both are None, inf when only one is)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, 1e-12)


def gradient_error(a: nn.Module, b: nn.Module) -> float:
    return max(relative(p.grad, q.grad)
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def weight_error(a: nn.Module, b: nn.Module) -> float:
    errors = [relative(p.detach(), q.detach())
              for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
              if p.is_floating_point()]
    return max(errors)


def as_numpy(x: Any) -> Any:
    return np.asarray(x)

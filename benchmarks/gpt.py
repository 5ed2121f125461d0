"""The one GPT of this repository: a small decoder-only transformer (GPT-2 style) for the benchmarks,
the examples and the Lightning tests. It is not part of the lazyckpt package (the wheel ships no model).

Dependency-free: torch only. Imported as ``benchmarks.gpt`` with the repository root on the path
(``python -m benchmarks.bench_core`` / ``python -m examples.train_plain`` from the root; pytest adds
the root itself)::

    from benchmarks import gpt

    cfg = gpt.config_for("100m")
    model = gpt.build(cfg, seed=0)                              # or gpt.build("100m")
    opt = gpt.make_optimizer(model)
    batches = gpt.BatchStream(cfg, seed=0)
    loss = gpt.train_step(model, opt, batches.next())

Sizes (parameters counted once; the LM head is tied to the token embedding, as in GPT-2):

=======  ======  =====  =====  =====  =====  ===========  =========================
size     layers  width  heads  vocab  seq    batch        params / full state (AdamW)
=======  ======  =====  =====  =====  =====  ===========  =========================
tiny     2       128    4      1024   64     4            ~0.5 M  / ~6 MB
small    6       384    6      8192   128    4            ~14 M   / ~0.17 GB
100m     12      768    12     16384  128    4            ~98 M   / ~1.2 GB
1b       18      2048   16     32768  256    2            ~0.97 B / ~11.7 GB
=======  ======  =====  =====  =====  =====  ===========  =========================

"full state" = fp32 weights + AdamW exp_avg + exp_avg_sq = 12 bytes per parameter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig",
    "SIZES",
    "config_for",
    "GPT",
    "build",
    "make_optimizer",
    "BatchStream",
    "train_step",
    "num_params",
    "state_bytes",
]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 16384
    block_size: int = 128  # sequence length used for training
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    batch_size: int = 4
    dropout: float = 0.0
    bias: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=128, batch_size=4),
    "small": GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=6, n_embd=384, batch_size=4),
    "100m": GPTConfig(vocab_size=16384, block_size=128, n_layer=12, n_head=12, n_embd=768, batch_size=4),
    "1b": GPTConfig(vocab_size=32768, block_size=256, n_layer=18, n_head=16, n_embd=2048, batch_size=2),
}


def config_for(size: str | GPTConfig, **overrides) -> GPTConfig:
    """The config for a named size (``tiny``, ``small``, ``100m``, ``1b``), with optional field overrides."""
    if isinstance(size, GPTConfig):
        cfg = size
    else:
        try:
            cfg = SIZES[size.lower()]
        except KeyError:
            raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}") from None
    return replace(cfg, **overrides) if overrides else cfg


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (GPT-2): one storage, two state_dict keys
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if self.cfg.block_size < T:
            raise ValueError(f"sequence length {T} > block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build(
    size: str | GPTConfig = "100m",
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    **overrides,
) -> GPT:
    """A freshly initialised model (deterministic for a given seed), on ``device``."""
    cfg = config_for(size, **overrides)
    g_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = GPT(cfg)
    finally:
        torch.random.set_rng_state(g_state)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model.to(device)


def make_optimizer(model: nn.Module, lr: float = 3e-4, weight_decay: float = 0.1, **kwargs) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (GPT-2 recipe). Two param groups."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():  # parameters() already de-duplicates the tied weight
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **kwargs)


class BatchStream:
    """Deterministic training batches of shape ``(batch_size, block_size)``.

    With ``data`` (a 1-D LongTensor of token ids, e.g. bytes of a text) it samples windows of it, so the
    model has something to learn; without it, uniformly random tokens (fine for timing).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        data: torch.Tensor | None = None,
        batch_size: int | None = None,
    ):
        self.cfg = cfg
        self.device = torch.device(device)
        self.batch_size = batch_size or cfg.batch_size
        self.gen = torch.Generator().manual_seed(seed)
        if data is not None:
            data = torch.as_tensor(data, dtype=torch.long).flatten()
            if data.numel() < cfg.block_size + 2:
                raise ValueError("data is shorter than one training window")
            if int(data.max()) >= cfg.vocab_size:
                raise ValueError("data has token ids >= vocab_size")
        self.data = data

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.batch_size, self.cfg.block_size
        if self.data is None:
            seq = torch.randint(0, self.cfg.vocab_size, (B, T + 1), generator=self.gen)
        else:
            starts = torch.randint(0, self.data.numel() - T - 1, (B,), generator=self.gen)
            seq = torch.stack([self.data[s : s + T + 1] for s in starts.tolist()])
        x, y = seq[:, :-1], seq[:, 1:]
        if self.device.type != "cpu":
            x = x.pin_memory().to(self.device, non_blocking=True)
            y = y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    __next__ = next

    def __iter__(self):
        return self


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, *, before_step=None) -> torch.Tensor:
    """zero_grad, forward, backward, [before_step()], optimizer.step(). Returns the loss (a detached tensor).

    ``before_step`` is a hook for peers that must be waited on right before the parameters change
    (e.g. DCP's ``staging_completion``); lazyckpt needs none, its global step pre-hook does that.
    """
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    if before_step is not None:
        before_step()
    optimizer.step()
    return loss.detach()


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def state_bytes(obj) -> int:
    """Bytes of distinct tensor storages in a (nested) state dict, as torch.save would store them."""
    seen: set = set()
    total = 0

    def visit(o):
        nonlocal total
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            key = (st.device, st.data_ptr(), st.nbytes())
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)

    visit(obj)
    return total

"""Random expert blocks laid out in a pool as the engine lays them (pagedweight/bitplanes.py's planes, the page
table's device tables), for kernel tests and benchmarks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedweight.bitplanes import lut_bytes, num_words, pack_planes, plane_bytes

ALIGN = 256  # bytes; the page pool's page sizes are multiples of this


@dataclass
class SyntheticMoE:
    """One layer's E experts (gate_up [2F, D], down [D, F]) at parent width P, every LUT_b (seed <= b <= P)."""

    pool: torch.Tensor  # uint8
    plane_off: torch.Tensor  # int64 [E, 2, P], words
    lut_offs: torch.Tensor  # int64 [E, 2, P + 1], halves; -1 below the seed width
    D: int
    F: int
    P: int
    seed_bits: int

    @property
    def pool_words(self) -> torch.Tensor:
        return self.pool.view(torch.uint32)

    @property
    def pool_halves(self) -> torch.Tensor:
        return self.pool.view(torch.float16)

    @property
    def E(self) -> int:
        return self.plane_off.shape[0]

    def tables(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device tables (q int32 [E,2], plane_off int64 [E,2,P], lut_off int64 [E,2]) for committed widths q."""
        q = q.to(torch.int64).cpu()
        if int(q.min()) < self.seed_bits or int(q.max()) > self.P:
            raise ValueError(f"widths must lie in [{self.seed_bits}, {self.P}]")
        lut_off = torch.gather(self.lut_offs, 2, q.unsqueeze(-1)).squeeze(-1)
        dev = self.pool.device
        return q.to(torch.int32).to(dev), self.plane_off.clone().to(dev), lut_off.to(dev)

    def write_tables(self, q: torch.Tensor, q_dev: torch.Tensor, lut_off_dev: torch.Tensor) -> None:
        """Commit new widths in place into existing device tables (what a captured graph reads)."""
        q_new, _, lut_new = self.tables(q)
        q_dev.copy_(q_new)
        lut_off_dev.copy_(lut_new)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def build_synthetic_moe(E: int, D: int, F: int, P: int, seed_bits: int = 3, device: str | torch.device = "cpu",
                        seed: int = 0, shuffle: bool = True) -> SyntheticMoE:
    """Random parent indices packed with `pack_planes`, random fp16 LUTs scaled ~1/sqrt(K); blocks and planes are
    placed in shuffled order so that no kernel can rely on planes of one block being adjacent."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed + 1)  # bulk random indices drawn where they live
    shapes = [(2 * F, D), (D, F)]
    items = [(e, kind, "plane", p) for e in range(E) for kind in range(2) for p in range(P)]
    items += [(e, kind, "lut", b) for e in range(E) for kind in range(2) for b in range(seed_bits, P + 1)]
    order = torch.randperm(len(items), generator=g).tolist() if shuffle else list(range(len(items)))
    offsets: dict[tuple, int] = {}
    cursor = 0
    for j in order:
        e, kind, what, x = items[j]
        n, k = shapes[kind]
        offsets[items[j]] = cursor
        cursor += _align(plane_bytes(n, k) if what == "plane" else lut_bytes(n, x))
    pool = torch.zeros(cursor, dtype=torch.uint8, device=device)
    words, halves = pool.view(torch.int32), pool.view(torch.float16)
    plane_off = torch.empty(E, 2, P, dtype=torch.int64)
    lut_offs = torch.full((E, 2, P + 1), -1, dtype=torch.int64)
    for e in range(E):
        for kind, (n, k) in enumerate(shapes):
            idx = torch.randint(0, 1 << P, (n, k), generator=gd, device=device, dtype=torch.uint8)
            planes = pack_planes(idx, P).view(torch.int32)
            W = num_words(k)
            for p in range(P):
                o = offsets[(e, kind, "plane", p)] // 4
                words[o:o + W * n] = planes[p].reshape(-1)
                plane_off[e, kind, p] = o
            for b in range(seed_bits, P + 1):
                lut = (torch.randn(1 << b, n, generator=g) / k ** 0.5).to(torch.float16)
                o = offsets[(e, kind, "lut", b)] // 2
                halves[o:o + (1 << b) * n] = lut.reshape(-1).to(device)
                lut_offs[e, kind, b] = o
    return SyntheticMoE(pool, plane_off, lut_offs, D, F, P, seed_bits)

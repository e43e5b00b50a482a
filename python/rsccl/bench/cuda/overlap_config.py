"""The overlap section's configuration (see overlap.py): what it runs, its --quick form, and
the command line's checks of it. Apart from overlap.py so that the bench's Config (config.py)
and the command line (cli.py) can name it without importing what runs the section.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common import human

MiB = 1 << 20
OVERLAP_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor")
MATMUL_MIN, MATMUL_MAX, MATMUL_MULTIPLE = 64, 32768, 64
BYTES_MIN, BYTES_MAX = 1 << 10, 4 << 30
REPEATS_MIN = 3  # medians and a spread need at least three runs per backend


@dataclass(frozen=True)
class OverlapConfig:
    """What the section runs; picklable, it travels to the ranks inside the bench's Config.

    The defaults are meant to keep both streams busy for a similar time on 2-4 H200s (an
    8192^3 bf16 matmul ~1.5-2 ms; a round of 64+128+256 MiB all_gather and reduce_scatter
    ~1.3-2 ms at ~350 GB/s): an estimate, not a measurement; the report gives both alone."""

    matmul: int = 8192  # n of the (n x n) @ (n x n) bf16 matmul
    matmuls: int = 20  # matmuls per window
    sizes: tuple[int, ...] = (64 * MiB, 128 * MiB, 256 * MiB)  # per rank: all_gather OUTPUT, reduce_scatter INPUT bytes
    rounds: int = 16  # rounds per window: one call of each collective per size
    repeats: int = 3  # runs per backend, in ABBA order
    # The collectives of a round, in this order (one of them alone tells its cost apart,
    # e.g. on the copy engines: all_gather's barrier kernels vs reduce_scatter's reduce kernel).
    collectives: tuple[str, ...] = OVERLAP_COLLECTIVES

    def describe(self) -> str:
        n = self.matmul
        return (
            f"{self.matmuls} x bf16 matmul {n}x{n}x{n} ({2 * n**3 * self.matmuls / 1e12:.2f} TFLOP) against "
            f"{self.rounds} x ({' + '.join(self.collectives)}) at {', '.join(human(s) for s in self.sizes)} "
            f"({self.calls()} calls) on a side stream; {self.repeats} runs per backend, ABBA"
        )

    def calls(self) -> int:
        return self.rounds * len(self.collectives) * len(self.sizes)

    def pool_bytes(self) -> int:
        """Bytes the section's rsccl-pool run takes from rsccl's pool at once: per size s and
        collective, s (the all_gather's output, the reduce_scatter's input: the buffers rsccl
        uses in place; their other buffers come from torch's allocator), all live together."""
        return len(self.collectives) * sum(self.sizes)


# --quick: small enough to finish in seconds, still both streams and every phase.
QUICK = OverlapConfig(matmul=2048, matmuls=8, sizes=(1 * MiB, 4 * MiB), rounds=4, repeats=3)


def config_problems(c: OverlapConfig) -> list[str]:
    """What is wrong with a configuration, one message per problem naming the flag (empty: fine)."""
    out = []
    if not (MATMUL_MIN <= c.matmul <= MATMUL_MAX) or c.matmul % MATMUL_MULTIPLE:
        out.append(
            f"--overlap-matmul {c.matmul}: give a multiple of {MATMUL_MULTIPLE} from {MATMUL_MIN} to {MATMUL_MAX} (n of an n x n x n matmul)"
        )
    if c.matmuls < 1:
        out.append(f"--overlap-matmuls {c.matmuls}: give at least 1 (matmuls per window)")
    if c.rounds < 1:
        out.append(f"--overlap-rounds {c.rounds}: give at least 1 (rounds of collectives per window)")
    if c.repeats < REPEATS_MIN:
        out.append(f"--overlap-repeats {c.repeats}: give at least {REPEATS_MIN} (medians and spreads of ABBA runs)")
    if not c.sizes:
        out.append("--overlap-bytes: give at least one message size")
    bad = [s for s in c.sizes if not BYTES_MIN <= s <= BYTES_MAX]
    if bad:
        out.append(
            f"--overlap-bytes {', '.join(human(s) for s in bad)}: each size must be from {human(BYTES_MIN)} to {human(BYTES_MAX)} "
            "(per rank: the all_gather output, the reduce_scatter input)"
        )
    bad = [x for x in c.collectives if x not in OVERLAP_COLLECTIVES]
    if not c.collectives or bad or len(set(c.collectives)) != len(c.collectives):
        out.append(
            f"--overlap-collectives {','.join(c.collectives) or '(none)'}: give one or both of {','.join(OVERLAP_COLLECTIVES)}, each once"
        )
    if len(set(c.sizes)) != len(c.sizes):
        out.append(f"--overlap-bytes {', '.join(human(s) for s in c.sizes)}: a size is given twice")
    return out

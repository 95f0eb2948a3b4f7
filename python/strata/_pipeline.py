"""The prefetch pipeline from Python: record a loop's steps once, then replay them with every
step's tensors brought ahead of it (as in C++, strata/scheduler/prefetch_pipeline.h)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from . import _core
from ._core import Access, Tier
from ._runtime import Lease, Runtime, Tensor


class PrefetchPipeline:
    """Drives a loop of steps over a Runtime. The first iteration records which tensors each
    step uses; later ones prefetch them (``prefetch="auto"``: as far ahead as the budgets
    allow; ``"fixed"``: ``fixed_lookahead`` steps; ``"none"``: on demand)::

        pipe = strata.PrefetchPipeline(rt)
        for _ in range(epochs):
            with pipe.iteration():
                for i, w in enumerate(weights):
                    with pipe.step(f"layer{i}", [(w, strata.Tier.DEVICE, strata.Access.READ)]) as (lease,):
                        y = x @ torch.from_dlpack(lease)
    """

    def __init__(
        self,
        runtime: Runtime,
        prefetch: str = "auto",
        fixed_lookahead: int = 2,
        write_back: bool = True,
        across_iterations: bool = True,
        arrival_in_pieces: bool = True,
        budget_fraction: float = 1.0,
        device_reserve: int = 0,
        host_reserve: int = 0,
    ) -> None:
        """`budget_fraction`: the share of the device budget (and of the host tier) the prefetch
        windows may take; `device_reserve` / `host_reserve`: bytes of each they leave to what
        the loop leases inside its steps beside the steps' tensors (an expert cache, a KV
        cache's pages)."""
        self._runtime = runtime
        # How it was made: a user of the same runtime that leases device room inside a step
        # (a KV cache) makes it again with arrival_in_pieces=False (Note [Arrival in pieces]).
        self.options = {
            "prefetch": prefetch,
            "fixed_lookahead": fixed_lookahead,
            "write_back": write_back,
            "across_iterations": across_iterations,
            "arrival_in_pieces": arrival_in_pieces,
            "budget_fraction": budget_fraction,
            "device_reserve": device_reserve,
            "host_reserve": host_reserve,
        }
        self._core = _core.PrefetchPipeline(
            runtime._core,
            prefetch,
            fixed_lookahead,
            write_back,
            across_iterations,
            arrival_in_pieces,
            budget_fraction,
            device_reserve,
            host_reserve,
        )

    @contextmanager
    def iteration(self) -> Iterator[PrefetchPipeline]:
        """One pass of the loop; its end rethrows the first failure of a prefetch or write-back."""
        self._core.begin_iteration()
        try:
            yield self
        finally:
            self._core.end_iteration()

    @contextmanager
    def step(
        self, name: str, uses: Sequence[tuple[Tensor | int, Tier, Access]]
    ) -> Iterator[list[Lease]]:
        """Leases the step's tensors (blocking, without the GIL, until each is on its tier) and
        yields them in the order of `uses`; they end with the block."""
        ids = [(u[0].id if isinstance(u[0], Tensor) else int(u[0]), u[1], u[2]) for u in uses]
        cores = self._core.begin_step(name, ids)
        leases = [Lease(c, self._runtime.tensor(i)) for c, (i, _, _) in zip(cores, ids)]
        try:
            yield leases
        finally:
            for lease in leases:
                lease.release()
            self._core.end_step()

    def drain(self) -> None:
        """Waits (without the GIL) until the planner has issued what it can now and no
        write-back is queued or running: a step begun after it finds whatever the planner could
        bring ahead already on its way."""
        self._core.drain()

    def stats(self) -> dict[str, Any]:
        """Every field of the C++ PipelineStats: steps, prefetches (``prefetches`` whole,
        ``arrivals_in_pieces`` over a running step's room, ``host_prefetches`` staged on the
        host), inputs ready at their step's start, write-backs, the link rate measured."""
        return self._core.stats()

"""Hardware per pool: which accelerator each worker of a cluster models.

One grammar for `pdserve up --emulate`, `pdserve sim --hardware` and the simulated twin of
an emulated cluster:

    h100                                  every worker an H100
    h100,l40s                             prefill H100, decode L40S (colocated: the first)
    prefill=h100,decode=l40s              the same, by role
    prefill=h100x2,decode=h100+h200       a '+' list is dealt to the pool's workers in order,
                                          cycling: decode0 H100, decode1 H200, decode2 H100, ...

A name is an accelerator of `costmodel.hardware.ACCELERATORS`, `xTP` for tensor parallel.
A pool named in none of the roles has no hardware: asking for it is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.costmodel.hardware import parse_hardware

ROLES = ("prefill", "decode", "colocated")
ANY = "*"


@dataclass(frozen=True)
class PoolHardware:
    """role (or ANY) -> the hardware its workers are dealt, in order."""

    pools: dict[str, tuple[str, ...]]

    @classmethod
    def parse(cls, spec: str) -> PoolHardware:
        parts = [p.strip().lower() for p in spec.split(",")]
        if not spec.strip() or not all(parts):
            raise ValueError(f"bad hardware {spec!r}: HW, PREFILL_HW,DECODE_HW or ROLE=HW[+HW]")
        pools: dict[str, tuple[str, ...]] = {}
        if all("=" not in p for p in parts):
            if len(parts) > 2:
                raise ValueError(f"bad hardware {spec!r}: at most PREFILL_HW,DECODE_HW")
            hws = [cls._one(spec, p) for p in parts]
            if len(hws) == 1:
                return cls({ANY: (hws[0],)})
            return cls({"prefill": (hws[0],), "colocated": (hws[0],), "decode": (hws[1],)})
        for p in parts:
            role, eq, names = p.partition("=")
            if not eq or role not in ROLES:
                raise ValueError(f"bad hardware {spec!r}: {p!r} is not ROLE=HW "
                                 f"(roles: {', '.join(ROLES)})")  # fmt: skip
            if role in pools:
                raise ValueError(f"bad hardware {spec!r}: {role} given twice")
            pools[role] = tuple(cls._one(spec, n) for n in names.split("+"))
        return cls(pools)

    @staticmethod
    def _one(spec: str, name: str) -> str:
        try:
            parse_hardware(name)
        except ValueError as exc:
            raise ValueError(f"bad hardware {spec!r}: {exc}") from None
        return name

    def has(self, role: str) -> bool:
        return ANY in self.pools or role in self.pools

    def for_worker(self, role: str, index: int) -> str:
        """The hardware of the `index`-th worker (from 0) of `role`'s pool."""
        hws = self.pools.get(role) or self.pools.get(ANY)
        if not hws:
            named = ", ".join(r for r in self.pools)
            raise ValueError(f"no hardware for the {role} pool (named: {named})")
        return hws[index % len(hws)]

    def pool(self, role: str, count: int) -> list[str]:
        """The hardware of each of `count` workers of `role`, in order."""
        return [self.for_worker(role, i) for i in range(count)]

    @property
    def uniform(self) -> str | None:
        """The one hardware of every worker, when there is one."""
        names = {h for hws in self.pools.values() for h in hws}
        return names.pop() if len(names) == 1 else None

"""Units and plain-text / Markdown tables of tools/bench_step.py (no JAX: the parent and the children both use it)."""
from __future__ import annotations

MIB = 2**20
GIB = 2**30


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "—"
    if abs(b) >= GIB:
        return f"{b / GIB:.2f} GiB"
    if abs(b) >= 10 * MIB:
        return f"{b / MIB:.0f} MiB"
    return f"{b / MIB:.1f} MiB"


def fmt_time(s: float | None) -> str:
    if s is None:
        return "—"
    if s >= 10:
        return f"{s:.1f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def fmt_ratio(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return "—"
    r = x / base
    return f"{r:.2f}x" if r >= 0.01 else f"{r:.3f}x"


class Table:
    def __init__(self, title: str, columns: list[str], align: str | None = None):
        self.title, self.columns, self.rows, self.notes = title, columns, [], []
        self.align = align or "l" + "r" * (len(columns) - 1)

    def add(self, *cells):
        self.rows.append([str(c) for c in cells])

    def text(self) -> str:
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
                  for i, c in enumerate(self.columns)]

        def line(cells):
            return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, self.align))

        out = [self.title, line(self.columns), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.rows]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)

    def markdown(self) -> str:
        sep = ["---" if a == "l" else "---:" for a in self.align]
        out = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |", "| " + " | ".join(sep) + " |"]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.notes:
            out.append("")
            out += [f"- {n}" for n in self.notes]
        return "\n".join(out)


"""A markdown table of an Nsight Compute raw-page CSV (`ncu --import R --csv --page raw`):
one row per profiled kernel with its launch shape, duration, DRAM bytes read and their rate.

    python3 scripts/profile_table.py profile.csv
"""

from __future__ import annotations

import csv
import re
import sys

UNITS = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3, "msecond": 1e3, "ms": 1e3}
BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6}


def short(name: str) -> str:
    """The kernel's class and method from a CuTe DSL mangled name; XLA's names as they are."""
    found = re.findall(r"(?:kernels|jax_kimik3)_?([A-Za-z]+?)_?([A-Z][A-Za-z]+)_", name)
    if found:
        return ".".join(found[0])
    return name[:60]


def main(path: str) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}

    def value(row, metric, scale):
        i = col[metric]
        text = row[i].replace(",", "")
        return float(text) * scale.get(units[i], 1.0) if text else float("nan")

    print("| # | kernel | grid | block | regs | µs | MB read | GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in data:
        us = value(row, "gpu__time_duration.sum", UNITS)
        mb = value(row, "dram__bytes_read.sum", BYTES) / 1e6
        print(f"| {row[col['ID']]} | {short(row[col['Kernel Name']])} | "
              f"{row[col['launch__grid_size']]} | {row[col['launch__block_size']]} | "
              f"{row[col['launch__registers_per_thread']]} | {us:.2f} | {mb:.2f} | "
              f"{mb * 1e3 / us:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])

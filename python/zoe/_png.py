"""A line plot written as a PNG with the standard library only (zlib + struct), so that the demo needs no
plotting package. Uses matplotlib instead where it is installed, for labelled axes."""
from __future__ import annotations

import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_rgb_png(path: str, width: int, height: int, pixels: bytearray) -> None:
    rows = b"".join(b"\x00" + bytes(pixels[y * width * 3:(y + 1) * width * 3]) for y in range(height))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        f.write(_chunk(b"IDAT", zlib.compress(rows, 9)))
        f.write(_chunk(b"IEND", b""))


def line_plot(path: str, series: dict[str, tuple[list[float], list[float]]], title: str = "",
              xlabel: str = "", ylabel: str = "") -> str:
    """Plots each (xs, ys) series; returns which renderer drew it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, label=name)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return "matplotlib"
    except ImportError:
        pass
    w, h, margin = 700, 420, 40
    px = bytearray(b"\xff" * (w * h * 3))

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            i = (y * w + x) * 3
            px[i:i + 3] = bytes(rgb)

    allx = [x for xs, _ in series.values() for x in xs] or [0.0, 1.0]
    ally = [y for _, ys in series.values() for y in ys] or [0.0, 1.0]
    x0, x1 = min(allx), max(allx) if max(allx) > min(allx) else min(allx) + 1
    y0, y1 = min(ally), max(ally) if max(ally) > min(ally) else min(ally) + 1

    def to_px(x: float, y: float) -> tuple[int, int]:
        return (margin + round((x - x0) / (x1 - x0) * (w - 2 * margin)),
                h - margin - round((y - y0) / (y1 - y0) * (h - 2 * margin)))

    for k in range(5):  # a light grid: quarters of each range
        gx = margin + k * (w - 2 * margin) // 4
        gy = margin + k * (h - 2 * margin) // 4
        for t in range(margin, h - margin):
            put(gx, t, (225, 225, 225))
        for t in range(margin, w - margin):
            put(t, gy, (225, 225, 225))
    for t in range(margin, w - margin + 1):
        put(t, h - margin, (0, 0, 0))
    for t in range(margin, h - margin + 1):
        put(margin, t, (0, 0, 0))
    colours = [(31, 119, 180), (255, 127, 14), (44, 160, 44)]
    for c, (xs, ys) in enumerate(series.values()):
        pts = [to_px(x, y) for x, y in zip(xs, ys)]
        for (ax_, ay), (bx, by) in zip(pts, pts[1:]):
            n = max(abs(bx - ax_), abs(by - ay), 1)
            for s in range(n + 1):
                put(ax_ + (bx - ax_) * s // n, ay + (by - ay) * s // n, colours[c % len(colours)])
    write_rgb_png(path, w, h, px)
    return "zoe._png (no axis labels; ranges are in the summary)"

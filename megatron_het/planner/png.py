"""A tiny RGB raster with filled rectangles and 5x7 bitmap text, written as PNG (zlib + struct).

Enough for the planner's charts without a plotting dependency. Text is upper-case: lower-case
letters are drawn as capitals and characters without a glyph as "?".
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

Color = tuple[int, int, int]

# 5x7 glyphs: seven rows, top first; bit 4 is the leftmost pixel.
_GLYPHS: dict[str, tuple[int, ...]] = {
    "0": (0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E),
    "1": (0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "2": (0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F),
    "3": (0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E),
    "4": (0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02),
    "5": (0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E),
    "6": (0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E),
    "7": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    "8": (0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E),
    "9": (0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C),
    "A": (0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "B": (0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E),
    "C": (0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E),
    "D": (0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C),
    "E": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F),
    "F": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10),
    "G": (0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F),
    "H": (0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "I": (0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "J": (0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C),
    "K": (0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11),
    "L": (0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F),
    "M": (0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11),
    "N": (0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11),
    "O": (0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E),
    "P": (0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10),
    "Q": (0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D),
    "R": (0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11),
    "S": (0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E),
    "T": (0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
    "U": (0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E),
    "V": (0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04),
    "W": (0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A),
    "X": (0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11),
    "Y": (0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04),
    "Z": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F),
    " ": (0, 0, 0, 0, 0, 0, 0), "-": (0, 0, 0, 0x1F, 0, 0, 0), ".": (0, 0, 0, 0, 0, 0x0C, 0x0C),
    ":": (0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0), "/": (0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10),
    "%": (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03), "=": (0, 0, 0x1F, 0, 0x1F, 0, 0),
    "(": (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02),
    ")": (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08),
    "[": (0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E),
    "]": (0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E),
    "+": (0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0), ",": (0, 0, 0, 0, 0x0C, 0x04, 0x08),
    "_": (0, 0, 0, 0, 0, 0, 0x1F), ">": (0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08),
    ";": (0, 0x0C, 0x0C, 0, 0x0C, 0x04, 0x08), "?": (0x0E, 0x11, 0x01, 0x02, 0x04, 0, 0x04),
}
GLYPH_WIDTH, GLYPH_HEIGHT = 5, 7


class Canvas:
    """``width x height`` RGB pixels, filled with ``background``; (0, 0) is the top left."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"canvas size must be positive, got {width}x{height}")
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def rect(self, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
        """Fill pixels with x in [x0, x1) and y in [y0, y1) (rounded, clipped; at least one
        pixel wide when x1 > x0)."""
        left, top = max(0, int(round(x0))), max(0, int(round(y0)))
        right = min(self.width, max(int(round(x1)), left + 1 if x1 > x0 else left))
        bottom = min(self.height, max(int(round(y1)), top + 1 if y1 > y0 else top))
        if right <= left or bottom <= top:
            return
        run = bytes(color) * (right - left)
        for y in range(top, bottom):
            self.rows[y][3 * left:3 * right] = run

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 1) -> int:
        """Draw ``text`` with its top left at (x, y); returns the x after the last glyph."""
        for ch in text.upper():
            glyph = _GLYPHS.get(ch, _GLYPHS["?"])
            for row, bits in enumerate(glyph):
                for col in range(GLYPH_WIDTH):
                    if bits >> (GLYPH_WIDTH - 1 - col) & 1:
                        self.rect(x + col * scale, y + row * scale, x + (col + 1) * scale,
                                  y + (row + 1) * scale, color)
            x += (GLYPH_WIDTH + 1) * scale
        return x

    def png_bytes(self) -> bytes:
        """The image as an 8-bit RGB PNG (no filtering, zlib level 9)."""
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
                + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.png_bytes())


def text_width(text: str, scale: int = 1) -> int:
    return len(text) * (GLYPH_WIDTH + 1) * scale


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode a PNG written by :meth:`Canvas.png_bytes` -> (width, height, RGB rows)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    pos, width, height, idat = 8, 0, 0, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"bad CRC in {kind!r} chunk")
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 3 * width + 1
    return width, height, [raw[y * stride + 1:(y + 1) * stride] for y in range(height)]


__all__ = ["Canvas", "Color", "read_png", "text_width"]

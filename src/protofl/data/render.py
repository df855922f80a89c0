"""SynthDigits-style digits rendered from the TrueType fonts that ship with matplotlib.

Each glyph is rasterised once per font (Pillow + FreeType), then every sample is drawn by one
batched inverse-affine bilinear lookup (scale, rotation, shear, stretch, translation), with
partial neighbouring digits on either side as in SynthDigits/SVHN crops, random foreground and
background colours with a minimum luminance contrast, a background gradient, optional Gaussian blur
and pixel noise. Everything is driven by one ``numpy.random.Generator`` seed, so the same seed gives
the same bytes (with the same Pillow/FreeType and matplotlib fonts).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from scipy.ndimage import gaussian_filter

log = logging.getLogger(__name__)

# Faces that carry proper lining digits at U+0030..U+0039 (checked by eye). Excluded: the
# *Display subsets and STIXNonUni/STIXSiz* (no digits), LastResort (placeholder boxes), cmex10 and
# cmsy10 (symbols at those code points) and cmmi10 (old-style figures).
FONT_FILES: tuple[str, ...] = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf",
    "DejaVuSerif-BoldItalic.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf",
    "STIXGeneralBolIta.ttf",
    "cmr10.ttf",
    "cmb10.ttf",
    "cmss10.ttf",
    "cmti10.ttf",
    "cmtt10.ttf",
)

GLYPH_PT = 32  # font size at which glyphs are rasterised
GLYPH_CANVAS = 48  # square canvas (pixels) holding one glyph, centred on its ink


def font_dir() -> Path:
    """matplotlib's bundled TrueType folder."""
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def digit_fonts() -> list[Path]:
    """Paths of the usable digit fonts that exist in this matplotlib installation."""
    folder = font_dir()
    paths = [folder / f for f in FONT_FILES if (folder / f).is_file()]
    if not paths:
        raise RuntimeError(f"no digit fonts found in {folder}; is matplotlib installed?")
    return paths


def _glyph(font_path: Path, char: str) -> np.ndarray:
    """One glyph as float32 coverage in [0, 1] on a GLYPH_CANVAS square, centred on its ink."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(str(font_path), GLYPH_PT)
    big = Image.new("L", (GLYPH_CANVAS * 2, GLYPH_CANVAS * 2), 0)
    ImageDraw.Draw(big).text((GLYPH_CANVAS, GLYPH_CANVAS), char, font=font, fill=255, anchor="mm")
    arr = np.asarray(big, dtype=np.float32) / 255.0
    ys, xs = np.nonzero(arr > 0.05)
    if ys.size == 0:
        return np.zeros((GLYPH_CANVAS, GLYPH_CANVAS), np.float32)
    cy = (ys.min() + ys.max()) // 2
    cx = (xs.min() + xs.max()) // 2
    h = GLYPH_CANVAS // 2
    out = np.zeros((GLYPH_CANVAS, GLYPH_CANVAS), np.float32)
    crop = arr[max(cy - h, 0) : cy + h, max(cx - h, 0) : cx + h]
    out[: crop.shape[0], : crop.shape[1]] = crop
    return out


def render_glyphs(fonts: list[Path] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rasterise digits 0-9 in every font.

    Returns ``masks`` [F, 10, C, C] float32, and the ink ``heights`` and ``widths`` [F, 10] in
    canvas pixels. Fonts whose digits are empty or not all distinct are dropped (with a log line).
    """
    fonts = digit_fonts() if fonts is None else fonts
    masks, heights, widths = [], [], []
    for path in fonts:
        glyphs = np.stack([_glyph(path, str(d)) for d in range(10)])
        ink = glyphs > 0.05
        flat = glyphs.reshape(10, -1)
        distinct = len({g.tobytes() for g in (flat > 0.5)}) == 10
        if not ink.reshape(10, -1).any(axis=1).all() or not distinct:
            log.warning("font %s does not render digits 0-9 properly; skipped", path.name)
            continue
        rows = np.asarray(ink.any(axis=2))
        cols = np.asarray(ink.any(axis=1))
        h = np.array([np.ptp(np.nonzero(rows[d])[0]) + 1 for d in range(10)], np.float32)
        w = np.array([np.ptp(np.nonzero(cols[d])[0]) + 1 for d in range(10)], np.float32)
        masks.append(glyphs)
        heights.append(h)
        widths.append(w)
    if not masks:
        raise RuntimeError("none of the fonts renders digits 0-9")
    return np.stack(masks), np.stack(heights), np.stack(widths)


def _bilinear(padded: np.ndarray, gid: np.ndarray, gx: np.ndarray, gy: np.ndarray) -> np.ndarray:
    """Sample glyph ``gid[i]`` at canvas coords (gx, gy)[i] bilinearly; zero outside the canvas.

    ``padded`` is [G, C + 4, C + 4] with a 2-pixel zero border, so clamped look-ups read zeros.
    """
    p = padded.shape[-1]
    gx = np.clip(gx + 2.0, 0.0, p - 1.001)
    gy = np.clip(gy + 2.0, 0.0, p - 1.001)
    x0 = gx.astype(np.int64)
    y0 = gy.astype(np.int64)
    fx = gx - x0
    fy = gy - y0
    base = padded.reshape(-1)
    idx = gid[:, None, None] * (p * p) + y0 * p + x0
    top = base[idx] * (1.0 - fx) + base[idx + 1] * fx
    bottom = base[idx + p] * (1.0 - fx) + base[idx + p + 1] * fx
    return top * (1.0 - fy) + bottom * fy


def _luminance(rgb: np.ndarray) -> np.ndarray:
    return rgb @ np.array([0.299, 0.587, 0.114], np.float32)


def _colours(
    rng: np.random.Generator, n: int, min_contrast: float
) -> tuple[np.ndarray, np.ndarray]:
    """Foreground and background RGB colours whose luminances differ by at least min_contrast."""
    fg = rng.uniform(0, 255, (n, 3)).astype(np.float32)
    bg = rng.uniform(0, 255, (n, 3)).astype(np.float32)
    bad = np.abs(_luminance(fg) - _luminance(bg)) < min_contrast
    while bad.any():
        k = int(bad.sum())
        fg[bad] = rng.uniform(0, 255, (k, 3))
        bg[bad] = rng.uniform(0, 255, (k, 3))
        bad = np.abs(_luminance(fg) - _luminance(bg)) < min_contrast
    return fg, bg


def synth_digits(
    n: int,
    seed: int,
    size: int = 32,
    *,
    glyphs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    chunk: int = 2048,
) -> tuple[np.ndarray, np.ndarray]:
    """Render ``n`` SynthDigits-style images (uint8 [n, size, size, 3]) with balanced labels."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    masks, heights, widths = glyphs if glyphs is not None else render_glyphs()
    n_fonts = masks.shape[0]
    flat = np.pad(
        masks.reshape(n_fonts * 10, masks.shape[-2], masks.shape[-1]), ((0, 0), (2, 2), (2, 2))
    )
    half = masks.shape[-1] / 2.0
    rng = np.random.default_rng(seed)

    labels = rng.permutation(np.arange(n) % 10).astype(np.int64)
    font = rng.integers(0, n_fonts, n)
    target_h = rng.uniform(0.55, 0.85, n) * size
    scale = target_h / heights[font, labels]
    theta = np.deg2rad(np.clip(rng.normal(0.0, 8.0, n), -25, 25))
    shear = rng.uniform(-0.2, 0.2, n)
    stretch = rng.uniform(0.8, 1.25, n)
    shift = rng.uniform(-0.08, 0.08, (n, 2)) * size
    neighbours = rng.integers(0, 10, (n, 2))
    has_nb = rng.random((n, 2)) < 0.35
    gap = rng.uniform(0.15, 0.4, (n, 2)) * heights[font, labels][:, None]
    fg, bg = _colours(rng, n, min_contrast=70.0)
    grad_amp = (rng.uniform(0, 40, (n, 1)) * (rng.random((n, 1)) < 0.5)).astype(np.float32)
    grad_dir = rng.uniform(0, 2 * np.pi, n)
    blur = rng.choice(np.array([0.0, 0.0, 0.5, 0.8]), n)
    noise = rng.uniform(0, 8, n)
    noise_seed = int(rng.integers(0, 2**31 - 1))

    # Inverse affine per sample: glyph = A^-1 (out - centre - shift); A = s R(theta) Shear Stretch.
    c, s_ = np.cos(theta), np.sin(theta)
    rot = np.stack([np.stack([c, -s_], -1), np.stack([s_, c], -1)], -2)
    shr = np.zeros((n, 2, 2))
    shr[:, 0, 0] = stretch
    shr[:, 0, 1] = shear
    shr[:, 1, 1] = 1.0
    fwd = scale[:, None, None] * rot @ shr
    inv = np.linalg.inv(fwd).astype(np.float32)

    coords = np.arange(size, dtype=np.float32) - (size - 1) / 2.0
    oy, ox = np.meshgrid(coords, coords, indexing="ij")
    xx, yy = np.meshgrid(coords / (size / 2.0), coords / (size / 2.0))
    half = np.float32(half)
    out = np.empty((n, size, size, 3), np.uint8)
    noise_rng = np.random.default_rng(noise_seed)
    for start in range(0, n, chunk):
        sl = slice(start, min(start + chunk, n))
        ux = ox[None] - shift[sl, 0, None, None].astype(np.float32)
        uy = oy[None] - shift[sl, 1, None, None].astype(np.float32)
        m = inv[sl]
        gx = m[:, 0, 0, None, None] * ux + m[:, 0, 1, None, None] * uy
        gy = m[:, 1, 0, None, None] * ux + m[:, 1, 1, None, None] * uy
        f, y = font[sl], labels[sl]
        cover = _bilinear(flat, f * 10 + y, gx + half, gy + half)
        for side, sign in ((0, -1.0), (1, 1.0)):
            k = np.nonzero(has_nb[sl, side])[0]
            nb = neighbours[sl, side][k]
            off = (widths[f[k], y[k]] / 2 + widths[f[k], nb] / 2 + gap[sl, side][k]).astype(
                np.float32
            )
            nb_cover = _bilinear(
                flat, f[k] * 10 + nb, gx[k] - sign * off[:, None, None] + half, gy[k] + half
            )
            cover[k] = np.maximum(cover[k], nb_cover)
        cover = np.clip(cover, 0.0, 1.0)[..., None]
        gd = grad_dir[sl]
        ramp = np.cos(gd)[:, None, None] * xx[None] + np.sin(gd)[:, None, None] * yy[None]
        back = bg[sl, None, None, :] + (grad_amp[sl, :, None] * ramp)[..., None].astype(np.float32)
        img = back * (1.0 - cover) + fg[sl, None, None, :] * cover
        for sigma in np.unique(blur[sl]):
            if sigma > 0:
                idx = np.nonzero(blur[sl] == sigma)[0]
                img[idx] = gaussian_filter(img[idx], sigma=(0, sigma, sigma, 0))
        img += noise_rng.standard_normal(img.shape, dtype=np.float32) * noise[
            sl, None, None, None
        ].astype(np.float32)
        out[sl] = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return out, labels

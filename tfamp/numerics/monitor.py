"""Writing a ``RangeReport``: ranges.txt / .json / .html / .png, and TensorBoard histograms.

Shared by ``tfamp.RangeMonitor`` (``tfamp.keras.range_monitor``), ``tfamp
inspect --ranges`` and the demo.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from tfamp.numerics import ranges as ranges_lib
from tfamp.numerics.range_report import RangeReport

log = logging.getLogger("tfamp")

# Batches a range probe collects by default, and where its files go.
DEFAULT_STEPS = 3
DEFAULT_OUTPUT_DIR = "tfamp_ranges"


def write_outputs(report: RangeReport, output_dir: str | os.PathLike, *,
                  png: bool = True) -> dict[str, Path]:
    """Writes ranges.txt, ranges.json, ranges.html and (with matplotlib) ranges.png.

    Returns:
      kind ("text", "json", "html", "png") -> path written.
    """
    from tfamp.numerics import plot as ranges_plot

    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = {"text": folder / "ranges.txt", "json": folder / "ranges.json",
               "html": folder / "ranges.html"}
    written["text"].write_text(report.full_text() + "\n")
    written["json"].write_text(report.to_json() + "\n")
    written["html"].write_text(ranges_plot.render_ranges_html(report))
    if png:
        try:
            ranges_plot.write_png(report, folder / "ranges.png")
            written["png"] = folder / "ranges.png"
        except ImportError as err:
            log.warning("tfamp: %s; the PNG was not written (the HTML page was).", err)
    return written


def write_tensorboard(report: RangeReport, log_dir: str | os.PathLike, step: int = 0) -> None:
    """Writes each tensor's log2 histogram to TensorBoard's Histograms tab.

    The values are log2|x| (x axis: exponent), written in the histogram
    plugin's own tensor format (what ``tf.summary.histogram`` writes), because
    only the on-device bucket counts exist, not the raw values.
    """
    import tensorflow as tf
    from tensorboard.plugins.histogram import metadata as histogram_metadata

    writer = tf.summary.create_file_writer(str(Path(log_dir) / "tfamp_ranges"))
    with writer.as_default():
        for entry in report.tensors:
            edges = np.arange(ranges_lib.E_MIN, ranges_lib.E_MAX + 2, dtype=np.float64)
            buckets = np.stack([edges[:-1], edges[1:], np.asarray(entry.counts, np.float64)],
                               axis=1)
            tag = f"tfamp_ranges/{entry.kind}/{entry.name}"
            metadata = histogram_metadata.create_summary_metadata(
                display_name=tag, description=f"log2|x| of {entry.name} ({entry.kind})")
            tf.summary.write(tag, tf.constant(buckets), step=step, metadata=metadata)
    writer.flush()
    writer.close()

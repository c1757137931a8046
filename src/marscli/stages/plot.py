"""`marscli plot METRICS_OR_RUN -o OUT.png`: the curves of a run (view/plot.py) as one PNG,
written atomically (`-`: stdout); how many panels on stderr."""

from __future__ import annotations

import sys

from marscli.records.outputs import write_output
from marscli.records.provenance import stage_inputs
from marscli.view.plot import panels_for, render_png


@stage_inputs()
def main(path: str, output: str, title: str | None = None) -> int:
    """Write the curves of `path` to `output`; returns the number of panels."""
    name, panels = panels_for(path)
    png = render_png(panels, name if title is None else title)
    write_output(output, png)
    print(f"wrote {len(panels)} panels to {output}", file=sys.stderr)
    return len(panels)

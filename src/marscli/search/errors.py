"""How a search backend fails: `SearchError`, raised by the backends behind HTTP (after their
retries, or on a reply of the wrong shape) and by the summariser, and turned by the search tools
into a `search failed:` observation. Its own module so that the package's options
(`SearchOptions.client`), the backends and the tools all reach it without importing one another.
"""

from __future__ import annotations

from marscli.http import HttpError


class SearchError(HttpError):
    """A backend failed (after its retries, or with a reply of the wrong shape, which is not
    retried); the tools turn it into a `search failed:` observation."""

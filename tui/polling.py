"""The dashboards' common base: an app that re-reads its run directories on a timer.

``WatchApp`` (one run) and ``CompareApp`` (several) both poll: ``start_polling`` reads once at
mount and then every ``poll_s`` seconds through ``refresh_data``, which calls the app's own
``_refresh``.
"""

from __future__ import annotations

from textual.app import App
from textual.css.query import NoMatches


class PollingApp(App):
    """An app that calls its ``_refresh`` now and every ``poll_s`` seconds."""

    poll_s: float = 1.0

    def start_polling(self) -> None:
        self.refresh_data()
        self.set_interval(self.poll_s, self.refresh_data)

    def refresh_data(self) -> None:
        try:
            self._refresh()
        except NoMatches:  # the timer fired while the app was closing and its widgets are gone
            pass

    def _refresh(self) -> None:
        raise NotImplementedError

"""The console progress bar of a profile run: timed iterations (tasks pass, Program pairs pass)
and candidate-pair rounds done of all, with an ETA, fed by polling the driver actor's
``profile_progress_state`` from a background thread (rich)."""

from __future__ import annotations

__all__ = ["ProfileProgressBar"]


class ProfileProgressBar:
    """A context manager showing the bar while a profile run's workers are busy (``enabled``
    False: nothing shown); ``total``: the steps expected before the workers report their own."""

    def __init__(self, driver, total: int, enabled: bool = True, period_s: float = 1.0) -> None:
        self.driver, self.total, self.enabled, self.period_s = driver, total, enabled, period_s

    def __enter__(self):
        import threading

        if not self.enabled:
            return self
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("profiling {task.fields[phase]}"), BarColumn(),
                             TextColumn("{task.completed}/{task.total} (timed iterations, pair rounds)"),
                             TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        self._task = self._bar.add_task("profile", total=self.total, phase="(workers starting)")
        self._bar.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="tessera-profile-progress", daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        import ray

        while not self._stop.wait(self.period_s):
            try:
                done, total, phase = ray.get(self.driver.profile_progress_state.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a slow driver only delays the bar
                continue
            self._bar.update(self._task, completed=done, total=total or self.total, phase=phase)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join(timeout=15)
            self._bar.stop()

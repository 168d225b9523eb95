"""Value rules of the recipe's ``autopilot`` section (the running job's own re-planning,
``docs/operations.md``, "Autopilot").

:func:`check_autopilot` is called by :func:`tessera.config.validate.validate_recipe`, so a bad
value is one :class:`~tessera.errors.TesseraConfigError` line (field, value, rule, fix; exit code
2) from every command, before Ray starts. The rules (also in ``docs/recipes.md``):

* ``autopilot.slowdown_threshold`` and ``autopilot.skew_threshold``: finite numbers > 1 (a
  factor over the conditions the running plan was made for; 1 would re-plan on every check);
* ``autopilot.margin``: in [0, 1) (a fraction of the simulated iteration time);
* ``autopilot.holdoff_steps``: >= 0; ``autopilot.checks`` and ``autopilot.verify_steps``: >= 1;
  ``autopilot.max_switches_per_hour``: >= 0;
* ``autopilot.replan_time_s``: a finite number > 0 seconds;
* with ``autopilot.enabled``: ``profile.check_every`` > 0 (the checks time the tasks the
  estimates come from at those steps).
"""

from __future__ import annotations

import math

from tessera.errors import TesseraConfigError


def check_autopilot(recipe) -> None:
    """Check the ``autopilot`` section's value rules (module docstring), in order.

    Args:
        recipe: a :class:`tessera.config.load.Recipe`.

    Raises:
        TesseraConfigError: the first broken rule (field, value, rule, fix).
    """
    a = recipe.autopilot
    checks = (
        ("autopilot.slowdown_threshold", a.slowdown_threshold, 1 < a.slowdown_threshold < math.inf,
         "must be a finite number > 1 (a rank's slowdown over the one the plan was made for)",
         "use e.g. 1.15 (react to a rank 15% slower)"),
        ("autopilot.skew_threshold", a.skew_threshold, 1 < a.skew_threshold < math.inf,
         "must be a finite number > 1 (the routing skew over the one the plan was made for)", "use e.g. 1.3"),
        ("autopilot.margin", a.margin, 0 <= a.margin < 1,
         "must be in [0, 1) (the predicted gain, a fraction of the iteration time, a switch must beat)",
         "use e.g. 0.05"),
        ("autopilot.holdoff_steps", a.holdoff_steps, a.holdoff_steps >= 0, "must be >= 0 (steps)", "use e.g. 20"),
        ("autopilot.checks", a.checks, a.checks >= 1, "must be >= 1 (checks a median is taken over)",
         "use e.g. 3"),
        ("autopilot.verify_steps", a.verify_steps, a.verify_steps >= 1,
         "must be >= 1 (iterations timed after a switch)", "use e.g. 10"),
        ("autopilot.max_switches_per_hour", a.max_switches_per_hour, a.max_switches_per_hour >= 0,
         "must be >= 0", "use e.g. 4 (0: decide and record, never switch)"),
        ("autopilot.replan_time_s", a.replan_time_s, 0 < a.replan_time_s < math.inf,
         "must be a finite number > 0 seconds", "use e.g. 60"),
        ("profile.check_every", recipe.profile.check_every, not a.enabled or recipe.profile.check_every > 0,
         "must be > 0 with autopilot.enabled=true (the autopilot's checks time the tasks at those steps)",
         "use e.g. profile.check_every=10, or autopilot.enabled=false"),
    )
    for field, value, ok, rule, fix in checks:
        if not ok:
            raise TesseraConfigError(field, value, rule, fix)

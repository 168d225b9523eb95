"""Recipes: the user's YAML and ``key=value`` overrides -> a frozen, validated :class:`Recipe`.

Layer 6 (beside :mod:`tessera.model`; see ``docs/CONTRACTS.md``): it reads specs and cost
sources below it and the Program memory rule of :mod:`tessera.program`, and nothing above.

* :mod:`~tessera.config.schema`: the typed sections (frozen dataclasses, so omegaconf makes
  read-only structured configs of them; a Recipe's sections are these types);
* :mod:`~tessera.config.load`: ``load_recipe(path, overrides)``, ``recipe_from_dict``, the
  shipped recipes (package data ``tessera/recipes/``) and the default recipe;
* :mod:`~tessera.config.resolve`: the model source (preset, HF ``config.json``, inline) and the
  hardware -> ``ModelSpec`` / ``HardwareSpec``;
* :mod:`~tessera.config.validate`, :mod:`~tessera.config.layout_rules`,
  :mod:`~tessera.config.model_checks`, :mod:`~tessera.config.limits`: value rules with one-line
  errors (field, value, rule, fix), and :mod:`~tessera.config.suggest` for fixes checked against
  the same rules; :mod:`~tessera.config.frozen`: the hashable dict of dict-valued fields.

A new recipe section is a frozen dataclass in ``schema.py`` (loading picks it up from
``RecipeConfig``), its rules beside the others, and its rows in ``docs/recipes.md``.
"""

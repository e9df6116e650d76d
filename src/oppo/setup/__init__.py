"""Building a run: :mod:`.plan` decides from the config what to build (paths, placement, engine
settings) before any model loads; :mod:`.roles` loads the models and builds every role once."""

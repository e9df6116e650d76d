"""Building a run: :mod:`.decide` decides from the config what to build (paths, placement, engine
settings) before any model loads; :mod:`.build` loads the models and builds every role once."""

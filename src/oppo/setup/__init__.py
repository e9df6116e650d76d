"""From a config to the roles, in one straight path: the objects split from the settings and every
input checked once (:mod:`.check`: the settings validated, then :mod:`.preflight`, which asks each
concern's owner), then :mod:`.build`: the built-in task prepared, objects saved for roles that load
elsewhere, the run decided (:mod:`.resolve`), the models loaded (:mod:`.load`), each role built
where its placement puts it, the weight sync composed."""

"""From a config to the roles, in one straight path: load (``config.load_config``) -> validate once
(``config.parse.validate_once``) -> preflight once, paths and objects alike (``oppo.preflight``:
``run.plan_run`` for ``oppo train`` and ``oppo.train``, ``Trainer`` for one built in code) -> build
(:mod:`.build`): decide what to build (:mod:`.resolve`: paths, algorithm, devices, placement), load
the models (:mod:`.load`), build each role where its placement puts it, compose the weight sync."""

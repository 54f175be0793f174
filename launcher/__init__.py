"""The ``rollmesh`` command (:mod:`.cli`), the local launcher and the main job, above the servers:
``rollmesh train``, ``up``, ``status`` and ``top``.

It is the only package that knows several servers: it starts them as
processes (:mod:`.processes`), derives each one's config from one job YAML
(:mod:`.job_config`), runs the main job (:mod:`.train`, :mod:`.train_job`),
draws the resource-time picture (:mod:`.resource_picture`), collects spans
(:mod:`.span_sink`) and prints the run report (:mod:`.train_report`).
"""

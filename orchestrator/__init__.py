"""orchestrate: experiment orchestration for text-to-speech inference speed-ups.

The core is a set of rooms, each importing only those below it (checked by import-linter,
see `.importlinter`):

    cli        commands (typer)
    reports    tables and figures, read through the store
    explore    the autonomous exploration loop: propose, measure, remeasure, gate, decide
    research   the protocol: noise, holdout, scoring, decide, gate
    running    plan -> executor (queue, pool) -> worker subprocess -> result record (the worker
               imports no store)
    store      the only module that speaks SQL (runs, the job queue); MLflow tracking beside it
    api        the plugin contracts and config types: techniques, families, scorers

Plugins (`orchestrate.families`, `orchestrate.techniques`, `orchestrate.scorers`,
`orchestrate.proposers`) import only `orchestrate.api`, and are found through entry points,
never imported by the core.
"""

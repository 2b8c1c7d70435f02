"""`orchestrate explore`: the autonomous exploration loop (propose, measure, remeasure, gate,
decide, ledger), between the commands above it and the research protocol below it.

    loop.py       the loop, top to bottom
    decisions.py  what a measured candidate earns (pure functions of its records)
    guards.py     measurements not to be believed (floor, prompt/seed independence, ...)
    jobs.py       the jobs a candidate is measured in, its canonical name and identity
    submit.py     the Submitter: the exploration's jobs on the executor (a pool or a local worker)
    state.py      what proposers are shown (api.proposer.ExplorationState)
    plugins.py    proposer plugins (`orchestrate.proposers` entry points)
    budget.py     "2h", "30m", "200 jobs"
    tracking.py   MLflow, best effort: one parent run per exploration
"""

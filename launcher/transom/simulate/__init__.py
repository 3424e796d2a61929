"""`transom simulate`: goodput of large training jobs under failures, by discrete-event simulation.

- model.py     what a scenario is: cluster, failure process by cause, delays, strategies; presets
- engine.py    the seeded simulation of one scenario under one strategy: effective training time
               and lost GPU-hours by component
- plot.py      goodput against cluster size for each strategy, as a PNG (matplotlib, optional)
- cli.py       the command

Pure Python, no torch; the assumptions and their sources are in docs/simulation.md.
"""

"""One run's fits: the resolve step, config to objects, the LightningModules and the objectives.

One run's fits: config to objects, the LightningModules, and the objectives (what to train, test and
count).
"""

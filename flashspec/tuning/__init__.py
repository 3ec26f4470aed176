"""Choices measured on this machine (SPEC.md §13): what a forward costs by width
(:mod:`~flashspec.tuning.calibrate`), timers (:mod:`~flashspec.tuning.timing`), and the engine
configured from those measurements (:mod:`~flashspec.tuning.auto`)."""

"""Optimizer state in a layer's gradient layout, and the recorded trajectory of a run.

One job per module:

* ``optimizer_snapshot.py`` — :class:`OptimizerSnapshot`: a live view of an
  optimizer's state in the materialize layout of hooked layers' gradients;
* ``layout.py`` — parameter-shaped tensors in that layout (all or mask coordinates);
* ``sharding.py`` — where the state lives under DDP / FSDP1 / FSDP2 and reading it whole;
* ``preconditioner.py`` — :class:`GradientPreconditioner`: per-sample gradients
  through the optimizer's update rule (what ``HookManager(optimizer=...)`` buffers);
* ``names.py`` — :func:`optimizer_type`, :func:`hf_trainer_param_names`,
  :func:`optimizer_from_state_dict`;
* ``snapshots.py`` — :class:`TrajectorySnapshots`: per-step parameters, batches and
  moments on disk, and :class:`LazyDynamics` over them;
* ``dynamics.py`` — a step's moment entry (:func:`assemble_dynamics`) and the run's
  ``training_dynamics.json``.

The public names are imported from their public paths,
``dattri_llm.gradient.optimizer_state`` and ``dattri_llm.gradient.snapshots``
(and the callbacks in ``dattri_llm.gradient.callbacks``); this package imports
nothing from ``callbacks``.
"""

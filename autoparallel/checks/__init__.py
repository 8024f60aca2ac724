"""Checks that keep a run honest, in the order a run meets them (every
argument of the API is checked before tracing by :mod:`autoparallel.validation`,
which the pipeline's packages share):

* :mod:`.preflight`: mistakes found in the first second (input shapes
  against the mesh and constraints, plan files, pass options);
* :mod:`.provenance`: what a plan was made for, and that it is applied to
  the same model, mesh and inputs;
* :mod:`.agreement`: every rank of the job holds the same plan.
"""

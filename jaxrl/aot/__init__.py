"""A run planned for an accelerator it is not on: every program of a run config compiled by the
target's own compiler (XLA:TPU through libtpu's topology descriptions, XLA:GPU through a GPU
target description) on this machine, and what that says about memory and cost
(`python -m jaxrl.plan`, docs/plan.md). Modules: `targets`, `programs`, `report`, `plan`."""

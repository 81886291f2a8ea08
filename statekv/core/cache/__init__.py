"""The two-state cache a step streams through: the transformers ``Cache`` and the attention-and-selection every
step runs (`two_state`), one decoder layer's two states (`layer`), the carried state's forms (`forms`), one step
as a transaction (`transaction`), saving and resuming it (`persistence`)."""

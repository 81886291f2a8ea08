"""The two-state cache a step streams through: its layers and the attention-and-selection every step runs
(`two_state`), the carried state's forms (`forms`), one step as a transaction (`transaction`), saving and
resuming it (`persistence`)."""

"""Standing questions: a question evaluated against a live stream as it grows (`standing`: `StandingQuestion`,
`evaluate`, several streams' evaluations as rows of one batch) and what one evaluation reads at each layer
(`context`: the carried state and the new frames, placed in RoPE). What the questions steer is a carry rule's
part (`statekv.core.rules.steering`)."""

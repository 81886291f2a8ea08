"""Standing questions: a question evaluated against a live stream as it grows (`standing`: `StandingQuestion`,
`evaluate`, several streams' evaluations as rows of one batch), the drafts an evaluation checks in its prompt's
forward (`drafts`), what one evaluation reads at each layer (`context`: the carried state and the new frames, placed
in RoPE) and how it fits a bounded stream's range (`fitting`). What the questions steer is a carry rule's part
(`statekv.core.rules.steering`)."""

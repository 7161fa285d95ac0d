"""The vocabulary that client, controller and workers share: mesh math, array specs,
operation messages, framing and the control channel's codec, errors, trace spans. It
imports none of them."""

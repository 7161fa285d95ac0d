"""The vocabulary that client, controller and workers share: mesh math, array specs,
operation messages, framing, errors, trace spans. It imports none of them."""

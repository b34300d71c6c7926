"""When chunks move: the warm-up trace, the placement policies, their byte costs, an offline replay, inputs that grow
after the warm-up."""

"""The tuner and its database: search the knob space of one problem family, remember the winner."""

"""Config composition, typed schemas, value types and weight tags."""

"""Config composition, typed schemas, value types, weight tags and a table row's runs."""

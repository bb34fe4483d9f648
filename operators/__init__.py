"""The agents of the search (`evo.core.proposer.Proposer`s); `operators.registry` registers the built-ins."""

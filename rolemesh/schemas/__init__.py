"""JSON Schemas of the dispatcher protocol payloads, shipped with the package."""

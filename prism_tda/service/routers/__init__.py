"""One router per resource."""

from starlette.convertors import Convertor, register_url_convertor


class _Except(Convertor[str]):
    """A path segment other than the given literal: ``/documents/{doc_id:not_batch}`` leaves
    ``/documents/batch`` to its own route (so another method there is 405, not a bad id), while any
    other segment reaches the handler, whose validation answers a bad id 422."""

    literal = ""

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return str(value)


for _name, _literal in (("not_batch", "batch"), ("not_discover", "discover")):
    register_url_convertor(_name, type(_name, (_Except,), {"regex": f"(?!{_literal}$)[^/]+", "literal": _literal})())

"""rolemesh/api/keys.py: which configured key a request's Authorization header carries."""

from __future__ import annotations

from typing import Dict, Optional

from twisted.trial.unittest import SynchronousTestCase

from rolemesh.api.keys import ApiKeys
from rolemesh.base.errors import ApiError


class Request:
    def __init__(self, authorization: Optional[bytes] = None, key_checked: bool = False) -> None:
        self._headers: Dict[bytes, bytes] = {} if authorization is None else {b"authorization": authorization}
        self.key_checked = key_checked

    def getHeader(self, name: bytes) -> Optional[bytes]:  # noqa: N802
        return self._headers.get(name)


class ApiKeysTests(SynchronousTestCase):
    def test_without_keys_everything_passes(self) -> None:
        keys = ApiKeys()
        self.assertEqual(keys.index(None), (None, None))
        self.assertEqual(keys.index(b"Bearer anything"), (None, None))
        keys.authorize(Request())  # type: ignore[arg-type]

    def test_the_index_of_the_key_carried(self) -> None:
        keys = ApiKeys(["first", "second"])
        self.assertEqual(keys.index(b"Bearer first"), (None, 0))
        self.assertEqual(keys.index(b"bearer second"), (None, 1))
        self.assertEqual(keys.index(b"BEARER  second "), (None, 1))
        self.assertIsNone(keys.error(b"Bearer second"))

    def test_anything_else_is_401(self) -> None:
        keys = ApiKeys(["first"])
        for header in (None, b"", b"first", b"Basic first", b"Bearer firs", b"Bearer first2", b"Bearer"):
            error, index = keys.index(header)
            self.assertIsNone(index, header)
            assert error is not None
            # llama-server's own 401 says authentication_error; so does the node's
            self.assertEqual((error.status, error.type, error.code),
                             (401, "authentication_error", "invalid_api_key"), header)

    def test_use_changes_the_keys(self) -> None:
        keys = ApiKeys(["old"])
        keys.use(["new"])
        self.assertIsNotNone(keys.error(b"Bearer old"))
        self.assertIsNone(keys.error(b"Bearer new"))
        keys.use([])
        self.assertIsNone(keys.error(None))

    def test_authorize(self) -> None:
        keys = ApiKeys(["k"])
        keys.authorize(Request(b"Bearer k"))  # type: ignore[arg-type]
        keys.authorize(Request(None, key_checked=True))  # type: ignore[arg-type]  # the listener checked it
        with self.assertRaises(ApiError) as caught:
            keys.authorize(Request(b"Bearer x"))  # type: ignore[arg-type]
        self.assertEqual(caught.exception.status, 401)

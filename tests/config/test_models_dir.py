"""The models folder (issue 28, item 1): the naming rules of
:func:`rolemesh.config.models_dir.scan` (pure, hammered by hypothesis), the folding
into ``models`` and ``load_config`` on a real folder."""

from __future__ import annotations

import os
import string

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from rolemesh.base.errors import ConfigError
from rolemesh.children.llama_args import build_argv
from rolemesh.config.file import load_config, parse
from rolemesh.config.models_dir import FoundModel, ListedFile, merge, model_id_of, scan

names = st.text(alphabet=string.ascii_lowercase + string.digits + "._", min_size=1, max_size=12).filter(
    lambda n: not n.startswith(".") and not n.lower().startswith("mmproj"))


def ids(models):
    return sorted(m.model_id for m in models)


class ScanTests(SynchronousTestCase):
    def test_ids_from_file_names(self) -> None:
        found, notes = scan([ListedFile("qwen2.5-7b-q4_k_m.gguf"), ListedFile("B.GGUF")])
        self.assertEqual(ids(found), ["B", "qwen2.5-7b-q4_k_m"])
        self.assertEqual(notes, ())

    def test_split_model_is_one_model_served_from_its_first_part(self) -> None:
        parts = [ListedFile(f"big-0000{i}-of-00003.gguf") for i in (3, 1, 2)]
        found, notes = scan(parts)
        self.assertEqual(found, (FoundModel("big", "big-00001-of-00003.gguf", None,
                                            tuple(f"big-0000{i}-of-00003.gguf" for i in (1, 2, 3))),))
        self.assertEqual(notes, ())

    def test_split_model_missing_a_part_is_a_note(self) -> None:
        found, notes = scan([ListedFile("big-00001-of-00003.gguf"), ListedFile("big-00003-of-00003.gguf")])
        self.assertEqual(found, ())
        self.assertEqual(notes, ("big: split model without part(s) 2 of 3; not served",))

    def test_mmproj_pairs_with_the_one_model_of_its_folder(self) -> None:
        found, notes = scan([ListedFile("gemma/gemma-3-4b-it-q4.gguf"), ListedFile("gemma/mmproj-f16.gguf"),
                             ListedFile("other.gguf")])
        self.assertEqual({m.model_id: m.mmproj for m in found},
                         {"gemma-3-4b-it-q4": "gemma/mmproj-f16.gguf", "other": None})
        self.assertEqual(notes, ())

    def test_mmproj_pairs_by_name_among_several(self) -> None:
        found, notes = scan([ListedFile("llava-7b.gguf"), ListedFile("llava-7b-q8.gguf"),
                             ListedFile("mmproj-llava-7b-q8-f16.gguf"), ListedFile("mmproj-unknown.gguf")])
        self.assertEqual({m.model_id: m.mmproj for m in found},
                         {"llava-7b": None, "llava-7b-q8": "mmproj-llava-7b-q8-f16.gguf"})
        self.assertEqual(len(notes), 1)
        self.assertIn("mmproj-unknown.gguf: a multimodal projector with no model", notes[0])

    def test_unreadable_and_non_gguf_files_are_one_note_each(self) -> None:
        found, notes = scan([ListedFile("README.md"), ListedFile("bad.gguf", "not a GGUF file (bad magic)"),
                             ListedFile("locked.gguf", "cannot be read (Permission denied)"),
                             ListedFile(".partial.gguf"), ListedFile("ok.gguf")])
        self.assertEqual(ids(found), ["ok"])
        self.assertEqual(notes, ("README.md: not a .gguf file; not served",
                                 "bad.gguf: not a GGUF file (bad magic); not served",
                                 "locked.gguf: cannot be read (Permission denied); not served"))

    def test_an_id_found_twice_is_served_once(self) -> None:
        found, notes = scan([ListedFile("a/x.gguf"), ListedFile("b/x.gguf")])
        self.assertEqual([m.path for m in found], ["a/x.gguf"])
        self.assertEqual(notes, ("b/x.gguf: model id x is already a/x.gguf; not served",))

    @given(st.lists(st.tuples(st.sampled_from(["", "sub/", "other/"]), names,
                              st.sampled_from(["single", "split", "mmproj", "text", "bad"])), max_size=12))
    def test_every_file_is_served_paired_or_noted(self, spec) -> None:
        """Each listed file is a served model's file, a paired projector, or
        in exactly one note; model ids are unique and never carry .gguf or
        a part suffix; nothing is served from an mmproj file."""
        listing = []
        for folder, name, kind in spec:
            if kind == "single":
                listing.append(ListedFile(f"{folder}{name}.gguf"))
            elif kind == "split":
                listing += [ListedFile(f"{folder}{name}-0000{i}-of-00002.gguf") for i in (1, 2)]
            elif kind == "mmproj":
                listing.append(ListedFile(f"{folder}mmproj-{name}.gguf"))
            elif kind == "text":
                listing.append(ListedFile(f"{folder}{name}.txt"))
            else:
                listing.append(ListedFile(f"{folder}{name}.gguf", "not a GGUF file (bad magic)"))
        found, notes = scan(listing)
        self.assertEqual(len({m.model_id for m in found}), len(found))
        used = set()
        for m in found:
            self.assertFalse(os.path.basename(m.path).lower().startswith("mmproj"))
            self.assertEqual(model_id_of(os.path.basename(m.path)), m.model_id)
            self.assertIn(m.path, m.parts)
            used.update(m.parts)
            if m.mmproj:
                used.add(m.mmproj)
        for f in set(listing):
            if f.path in used:
                continue
            # A split model's parts are noted together: by its first part or by its name.
            stem = f.path.split("-0000", 1)[0]
            names = {f.path, stem, stem + "-00001-of-00002.gguf"}
            self.assertTrue(any(n.split(":", 1)[0] in names for n in notes), (f.path, notes))


class MergeTests(SynchronousTestCase):
    found = (FoundModel("a", "/m/a.gguf", "/m/mmproj-a.gguf", ("/m/a.gguf",)),
             FoundModel("b", "/m/b.gguf", None, ("/m/b.gguf",)))

    def test_an_entry_without_path_refines_the_found_model(self) -> None:
        models, notes = merge([{"model_id": "a", "roles": ["chat"], "ctx_size": 512}], self.found)
        self.assertEqual(models, [
            {"model_id": "a", "roles": ["chat"], "ctx_size": 512, "path": "/m/a.gguf", "mmproj": "/m/mmproj-a.gguf"},
            {"model_id": "b", "path": "/m/b.gguf"}])
        self.assertEqual(notes, ())
        config = parse({"models": models})
        self.assertEqual(config.model("a").roles, ("chat",))
        self.assertIn("/m/mmproj-a.gguf", build_argv("llama-server", config.model("a"), 1))

    def test_an_entry_with_its_own_path_wins(self) -> None:
        models, _ = merge([{"model_id": "b", "path": "/elsewhere/b.gguf"}], self.found)
        self.assertEqual([m["path"] for m in models], ["/elsewhere/b.gguf", "/m/a.gguf"])

    def test_an_entry_whose_file_is_gone_is_left_out_with_a_note(self) -> None:
        models, notes = merge([{"model_id": "gone", "roles": ["x"]}], self.found)
        self.assertEqual([m["model_id"] for m in models], ["a", "b"])
        self.assertEqual(notes, ("models[0]: no file in models_dir for model_id 'gone' and no path; not served",))

    def test_a_found_id_that_is_an_alias_is_not_served_twice(self) -> None:
        models, notes = merge([{"model_id": "x", "path": "/x.gguf", "alias": "a"}], self.found)
        self.assertEqual([m["model_id"] for m in models], ["x", "b"])
        self.assertIn("alias", notes[0])


class LoadTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        self.models = os.path.join(self.dir, "models")
        os.makedirs(os.path.join(self.models, "vision"))
        self.env = {"XDG_STATE_HOME": os.path.join(self.dir, "state")}

    def write(self, name: str, data: bytes = b"GGUF\x03\x00\x00\x00") -> str:
        path = os.path.join(self.models, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def config(self, text: str) -> str:
        path = os.path.join(self.dir, "node.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def test_folder_models_with_a_refining_entry_and_bad_files_logged(self) -> None:
        a = self.write("a.gguf")
        self.write("vision/v-q4.gguf")
        self.write("vision/mmproj-v-f16.gguf")
        self.write("notes.txt", b"hello")
        self.write("broken.gguf", b"PK\x03\x04")
        logged = []
        from twisted.logger import globalLogPublisher

        globalLogPublisher.addObserver(logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, logged.append)
        path = self.config(f"models_dir: {self.models}\nmodels:\n  - model_id: a\n    roles: [chat]\n")
        config = load_config(path, environ=self.env)
        self.assertEqual([(m.model_id, m.path, m.roles) for m in config.models],
                         [("a", a, ("chat",)), ("v-q4", os.path.join(self.models, "vision/v-q4.gguf"), ())])
        self.assertEqual(config.model("v-q4").mmproj, os.path.join(self.models, "vision/mmproj-v-f16.gguf"))
        self.assertEqual(config.models_dir, (self.models,))
        lines = sorted(e["note"] for e in logged if e.get("log_namespace") == "rolemesh.models_dir")
        self.assertEqual(lines, [f"models_dir {self.models}: broken.gguf: not a GGUF file (bad magic); not served",
                                 f"models_dir {self.models}: notes.txt: not a .gguf file; not served"])

    def test_a_missing_folder_is_a_note_not_a_failed_start(self) -> None:
        path = self.config(f"models_dir: [{self.models}, {self.dir}/nowhere]\n")
        self.write("x.gguf")
        self.assertEqual([m.model_id for m in load_config(path, environ=self.env).models], ["x"])

    def test_models_dir_must_be_a_path_or_list(self) -> None:
        path = self.config("models_dir: 3\n")
        e = self.assertRaises(ConfigError, load_config, path, environ=self.env)
        self.assertEqual(str(e), "models_dir: expected a folder path or a non-empty list of folder paths, got 3")


class CheckReportTests(SynchronousTestCase):
    def test_check_names_the_files_the_folder_left_out(self) -> None:
        import io

        from rolemesh.cli import template_report

        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        with open(os.path.join(folder, "notes.txt"), "w") as f:
            f.write("x")
        config = parse({"models_dir": folder})
        out = io.StringIO()
        template_report(config, out)
        self.assertIn(f"# WARNING: models_dir {folder}: notes.txt: not a .gguf file; not served\n", out.getvalue())

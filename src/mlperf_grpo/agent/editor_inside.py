"""The file editor, run INSIDE the sandbox (``python3 -I -c <this file>``, request as JSON
on stdin): paths resolve in the sandbox's own file system, so a link the model planted
cannot reach a host file; ``-I`` keeps the working folder (/testbed) off ``sys.path``, so
the repository's own ``json.py`` or ``re.py`` is not imported in place of the standard
library's. Standard library only, Python 3.6+ syntax (task images carry
old interpreters). Prints the observation; exit 0 done, 3 the request was refused (the
model's error), anything else the tool broke.

Commands as R2E-Gym's ``str_replace_editor`` (its default set: view, create, str_replace,
insert): view (a file as ``cat -n``, optionally ``view_range`` [start, end], end -1 for the
end; a folder 2 levels deep, hidden entries left out), create (not over an existing file),
str_replace (``old_str`` must occur exactly once), insert (``new_str`` after line
``insert_line``, 0 for the top).
"""

import json
import os
import sys

SNIPPET_LINES = 4


class Refused(Exception):
    pass


def numbered(lines, first):
    return "\n".join("%6d\t%s" % (first + i, line) for i, line in enumerate(lines))


def read_text(path, for_edit=False):
    if not os.path.exists(path):
        raise Refused("The path %s does not exist." % path)
    if os.path.isdir(path):
        raise Refused("The path %s is a directory; only `view` works on directories." % path)
    with open(path, "rb") as handle:
        data = handle.read()
    if b"\0" in data[:8192]:
        raise Refused("The file %s is binary; the editor shows and edits text files only." % path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        if for_edit:  # writing the decoded text back would replace the undecodable bytes
            raise Refused("The file %s is not UTF-8 text; edit it with a shell command instead." % path)
        return data.decode("utf-8", errors="replace")


def write_text(path, text):
    with open(path, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)


def view(path, view_range):
    if os.path.isdir(path):
        if view_range is not None:
            raise Refused("`view_range` is for files, and %s is a directory." % path)
        entries = []
        base_depth = path.rstrip("/").count("/")
        for folder, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            entries += [os.path.join(folder, name) for name in dirs + [f for f in files if not f.startswith(".")]]
            if folder.rstrip("/").count("/") - base_depth >= 1:  # path's entries and theirs: `find -maxdepth 2`
                dirs[:] = []
        return ("Files and directories up to 2 levels deep in %s, hidden ones left out:\n%s\n"
                % (path, "\n".join([path] + sorted(entries))))
    lines = read_text(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first, last = 1, len(lines)
    if view_range is not None:
        if (not isinstance(view_range, list) or len(view_range) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in view_range)):
            raise Refused("`view_range` must be two integers [start, end], e.g. [11, 20] or [11, -1].")
        first, end = view_range
        if not 1 <= first <= max(1, len(lines)):
            raise Refused("Invalid `view_range` %s: start must be in [1, %d]." % (view_range, len(lines)))
        if end != -1 and not first <= end <= len(lines):
            raise Refused("Invalid `view_range` %s: end must be in [%d, %d], or -1 for the end of the file."
                          % (view_range, first, len(lines)))
        last = len(lines) if end == -1 else end
    return "Here's the result of running `cat -n` on %s:\n%s\n" % (path, numbered(lines[first - 1:last], first))


def snippet(text, line, extra):
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    start = max(0, line - SNIPPET_LINES)
    end = min(len(lines), line + SNIPPET_LINES + extra + 1)
    return numbered(lines[start:end], start + 1)


def create(path, file_text):
    if file_text is None:
        raise Refused("`create` needs `file_text`, the content of the new file.")
    if os.path.lexists(path):
        raise Refused("File already exists at %s; `create` does not overwrite (use `str_replace`)." % path)
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent)
    write_text(path, file_text)
    return "File created successfully at %s.\n" % path


def str_replace(path, old_str, new_str):
    if old_str is None or old_str == "":
        raise Refused("`str_replace` needs a non-empty `old_str`, the exact text to replace.")
    new_str = new_str or ""
    text = read_text(path, for_edit=True)
    count = text.count(old_str)
    if count == 0:
        raise Refused("No replacement was performed: `old_str` does not occur verbatim in %s." % path)
    if count > 1:
        lines = [text[:i].count("\n") + 1 for i in occurrences(text, old_str)]
        raise Refused("No replacement was performed: `old_str` occurs %d times in %s (lines %s); "
                      "include more context to make it unique." % (count, path, lines))
    at = text.index(old_str)
    new_text = text[:at] + new_str + text[at + len(old_str):]
    write_text(path, new_text)
    line = text[:at].count("\n")
    return ("The file %s has been edited. Here's the result of running `cat -n` on a snippet of it:\n%s\n"
            "Review the changes and make sure they are as expected.\n"
            % (path, snippet(new_text, line, new_str.count("\n"))))


def occurrences(text, part):
    found, start = [], text.find(part)
    while start != -1:
        found.append(start)
        start = text.find(part, start + 1)
    return found


def insert(path, insert_line, new_str):
    if new_str is None:
        raise Refused("`insert` needs `new_str`, the text to insert.")
    if not isinstance(insert_line, int) or isinstance(insert_line, bool):
        raise Refused("`insert` needs `insert_line`, an integer (0 inserts at the top).")
    text = read_text(path, for_edit=True)
    lines = text.split("\n")
    has_final_newline = text.endswith("\n")
    count = len(lines) - 1 if has_final_newline else len(lines)
    if not 0 <= insert_line <= count:
        raise Refused("Invalid `insert_line` %d: it must be in [0, %d]." % (insert_line, count))
    inserted = new_str.split("\n")
    if new_str.endswith("\n"):
        inserted.pop()
    new_lines = lines[:insert_line] + inserted + lines[insert_line:]
    new_text = "\n".join(new_lines)
    write_text(path, new_text)
    return ("The file %s has been edited. Here's the result of running `cat -n` on a snippet of it:\n%s\n"
            "Review the changes and make sure they are as expected.\n"
            % (path, snippet(new_text, insert_line, len(inserted))))


def main():
    request = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    command, path = request.get("command"), request.get("path")
    path = os.path.normpath(os.path.join(os.getcwd(), path))
    try:
        if command == "view":
            out = view(path, request.get("view_range"))
        elif command == "create":
            out = create(path, request.get("file_text"))
        elif command == "str_replace":
            out = str_replace(path, request.get("old_str"), request.get("new_str"))
        elif command == "insert":
            out = insert(path, request.get("insert_line"), request.get("new_str"))
        else:
            raise Refused("Unknown command %r: use view, create, str_replace or insert." % command)
    except Refused as refused:
        sys.stdout.write("ERROR: %s\n" % refused)
        sys.exit(3)
    except OSError as error:
        sys.stdout.write("ERROR: %s: %s\n" % (path, error.strerror or error))
        sys.exit(3)
    sys.stdout.write(out)


if __name__ == "__main__":
    main()

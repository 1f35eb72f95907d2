// The playground's code editor: CodeMirror 6 with Python highlighting, synced to the Python `CodeEditor` widget.
// Every edit is pushed to the kernel at once, so a Run click always sees the text on screen. Ctrl/Cmd-Enter asks
// the kernel to run. The Python side marks a failing line through `error_line` (1-based, 0 = none).
import { EditorState, StateEffect, StateField, RangeSet } from "@codemirror/state";
import { EditorView, Decoration, keymap, lineNumbers, highlightActiveLine, drawSelection } from "@codemirror/view";
import { defaultKeymap, history, historyKeymap, indentWithTab } from "@codemirror/commands";
import { bracketMatching, indentOnInput, syntaxHighlighting, defaultHighlightStyle } from "@codemirror/language";
import { python } from "@codemirror/lang-python";

const setErrorLine = StateEffect.define();
const errorMark = Decoration.line({ class: "flexlab-error-line" });

// Holds the decoration of the line the kernel reported an error on; it follows edits until the next report.
const errorLineField = StateField.define({
  create: () => Decoration.none,
  update(deco, tr) {
    deco = deco.map(tr.changes);
    for (const effect of tr.effects) {
      if (!effect.is(setErrorLine)) continue;
      const line = effect.value;
      deco = line > 0 && line <= tr.state.doc.lines
        ? RangeSet.of([errorMark.range(tr.state.doc.line(line).from)])
        : Decoration.none;
    }
    return deco;
  },
  provide: (field) => EditorView.decorations.from(field),
});

function render({ model, el }) {
  el.classList.add("flexlab-editor");
  el.dataset.testid = "flexlab-editor";
  const runKeys = keymap.of([{
    key: "Mod-Enter",
    run: () => { model.send({ type: "run" }); return true; },
  }]);
  let applyingRemote = false;
  const view = new EditorView({
    parent: el,
    state: EditorState.create({
      doc: model.get("code"),
      extensions: [
        lineNumbers(), history(), drawSelection(), indentOnInput(), bracketMatching(), highlightActiveLine(),
        syntaxHighlighting(defaultHighlightStyle, { fallback: true }), python(), errorLineField,
        runKeys, keymap.of([indentWithTab, ...defaultKeymap, ...historyKeymap]),
        EditorState.tabSize.of(4),
        EditorView.updateListener.of((update) => {
          if (!update.docChanged || applyingRemote) return;
          model.set("code", update.state.doc.toString());
          model.save_changes();
        }),
      ],
    }),
  });
  view.contentDOM.setAttribute("aria-label", "score_mod / mask_mod source");

  const onCode = () => {
    const text = model.get("code");
    if (text === view.state.doc.toString()) return;
    applyingRemote = true;
    view.dispatch({ changes: { from: 0, to: view.state.doc.length, insert: text } });
    applyingRemote = false;
  };
  const onError = () => view.dispatch({ effects: setErrorLine.of(model.get("error_line")) });
  const onHeight = () => { view.dom.style.height = model.get("height"); };
  model.on("change:code", onCode);
  model.on("change:error_line", onError);
  model.on("change:height", onHeight);
  onHeight();
  onError();
  return () => {
    model.off("change:code", onCode);
    model.off("change:error_line", onError);
    model.off("change:height", onHeight);
    view.destroy();
  };
}

export default { render };

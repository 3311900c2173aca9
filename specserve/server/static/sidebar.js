// The list of saved conversations: open one, delete one. Titles are set with textContent.

export class Sidebar {
  constructor(list, { onOpen, onDelete }) {
    this.list = list;
    this.onOpen = onOpen;
    this.onDelete = onDelete;
  }

  render(conversations, currentId) {
    const doc = this.list.ownerDocument;
    this.list.replaceChildren(...conversations.map((conv) => {
      const li = doc.createElement("li");
      li.setAttribute("aria-current", String(conv.id === currentId));
      const open = doc.createElement("button");
      open.type = "button";
      open.className = "open-conv";
      open.textContent = conv.title;
      open.title = conv.title;
      open.addEventListener("click", () => this.onOpen(conv.id));
      const del = doc.createElement("button");
      del.type = "button";
      del.className = "delete-conv";
      del.textContent = "×";
      del.setAttribute("aria-label", `Delete conversation: ${conv.title}`);
      del.addEventListener("click", () => this.onDelete(conv.id));
      li.append(open, del);
      return li;
    }));
  }
}
